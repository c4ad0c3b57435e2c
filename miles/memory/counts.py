"""The torch-free record of a model's tensors, and the byte arithmetic on it.

A component (one `model_index.json` module) is a list of `TensorGroup`s: tensors of one shape class, with the dtype
rule its library's `from_pretrained(dtype=D)` applies to them. LoRA adapters are `AdapterGroup`s (their sizes are
linear in the rank), and the FSDP2 wrap of a denoiser is its per-block parameter counts (`FsdpGroups`).
`measure` fills these from meta-device builds; everything here is plain arithmetic on them.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = 1
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATING = ("float64", "float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")
# `--fsdp-master-dtype` / `--diffusion-forward-dtype` values -> torch dtype names
FLAG_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PARAM, BUFFER, LOCAL_BUFFER = "param", "buffer", "local_buffer"
LIBRARIES = ("diffusers", "transformers", "peft", "torch")


def dtype_name(flag_or_name: str) -> str:
    """`bf16` -> `bfloat16` (a torch dtype name passes through)."""
    return FLAG_DTYPES.get(flag_or_name, flag_or_name)


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[dtype_name(name)]


@dataclass(frozen=True)
class TensorGroup:
    """`count` tensors of `dim0 x rest` elements (a 0-d tensor: 1 x 1).

    kind: `param`; `buffer` (persistent: in the checkpoint, loaded like a parameter); `local_buffer` (built by the
    constructor, not loaded). made: the dtype the constructor gives it under a half default dtype: "" when it
    follows the default (hence the load dtype), else that fixed dtype (e.g. an inv_freq built in float32).
    pin: the library keeps it in fp32 when loading in "half" (fp16 or bf16: diffusers' `_keep_in_fp32_modules`,
    transformers' `_keep_in_fp32_modules_strict`) or "fp16" only (transformers' `_keep_in_fp32_modules`).
    """

    dim0: int
    rest: int
    count: int
    kind: str = PARAM
    made: str = ""
    pin: str = ""

    @property
    def size(self) -> int:
        return self.dim0 * self.rest

    @property
    def numel(self) -> int:
        return self.size * self.count

    def pinned(self, load: str) -> bool:
        return (self.pin == "half" and load in HALF) or (self.pin == "fp16" and load == "float16")

    def dtype_at(self, library: str, load: str) -> str:
        """The dtype `from_pretrained(dtype=load)` gives these tensors."""
        load = dtype_name(load)
        floating = self.made == "" or self.made in FLOATING
        if self.kind == LOCAL_BUFFER or not floating:
            return load if self.made == "" else self.made
        if self.pinned(load):
            return "float32"
        if library == "diffusers":  # every floating checkpoint tensor is cast to the load dtype
            return load
        return load if self.made == "" else self.made  # transformers keeps a constructor's other dtype

    def shard_size(self, shards: int) -> int:
        """Elements of one FSDP2 shard over `shards` ranks: rank 0's (the largest) chunk of dim 0, which is also
        the padded size every rank allocates (dim 0 is padded to a multiple of `shards`)."""
        return math.ceil(self.dim0 / shards) * self.rest


@dataclass(frozen=True)
class AdapterGroup:
    """`count` peft LoRA pairs on modules of one shape: A is `[r, *a]` (a_rest elements per row), B is
    `[b_rows, r, *b]` (b_rest elements per rank entry); an nn.Linear(in, out) target has a_rest=in, b_rows=out,
    b_rest=1. The adapter takes its base weight's dtype (peft moves it to the base layer's device and dtype), so
    `pin` is the base weight's."""

    component: str
    a_rest: int
    b_rows: int
    b_rest: int
    count: int
    pin: str = ""

    def numel(self, rank: int) -> int:
        return self.count * rank * (self.a_rest + self.b_rows * self.b_rest)

    def shard_size(self, rank: int, shards: int) -> int:
        """Elements of the pair's FSDP2 shards on rank 0 (see `TensorGroup.shard_size`), all `count` pairs."""
        a = math.ceil(rank / shards) * self.a_rest
        b = math.ceil(self.b_rows / shards) * rank * self.b_rest
        return self.count * (a + b)

    def tensors(self, rank: int) -> list[TensorGroup]:
        return [
            TensorGroup(rank, self.a_rest, self.count, PARAM, "", self.pin),
            TensorGroup(self.b_rows, rank * self.b_rest, self.count, PARAM, "", self.pin),
        ]


@dataclass(frozen=True)
class FsdpGroups:
    """A denoiser as FSDP2 wraps it: the parameter count of each block of the family's block lists (grouped as
    (numel, how many blocks)), and what is left to the root group. LoRA adapters are not included."""

    blocks: tuple[tuple[int, int], ...]
    root: int

    @property
    def largest_block(self) -> int:
        return max((n for n, _ in self.blocks), default=0)


@dataclass
class ComponentCounts:
    library: str
    class_name: str
    tensors: tuple[TensorGroup, ...]

    def of_kind(self, *kinds: str) -> list[TensorGroup]:
        return [t for t in self.tensors if t.kind in kinds]

    @property
    def parameters(self) -> int:
        return sum(t.numel for t in self.of_kind(PARAM))

    def bytes_by_dtype(self, load: str, *, cast: str | None = None, kinds: Iterable[str] = ()) -> dict[str, int]:
        """{dtype: bytes} of the tensors of `kinds` (all when empty) loaded with `dtype=load`; `cast` then moves
        every floating tensor to that dtype (`module.to(cast)`, e.g. the engine's fp32 VAE)."""
        wanted = tuple(kinds) or (PARAM, BUFFER, LOCAL_BUFFER)
        out: dict[str, int] = {}
        for t in self.of_kind(*wanted):
            dtype = t.dtype_at(self.library, load)
            if cast is not None and dtype in FLOATING:
                dtype = dtype_name(cast)
            out[dtype] = out.get(dtype, 0) + t.numel * DTYPE_BYTES[dtype]
        return out

    def total_bytes(self, load: str, *, cast: str | None = None, kinds: Iterable[str] = ()) -> int:
        return sum(self.bytes_by_dtype(load, cast=cast, kinds=kinds).values())


def lora_key(components: Iterable[str], targets: Iterable[str]) -> str:
    return ",".join(components) + "|" + ",".join(targets)


def fsdp_key(components: Iterable[str], block_lists: Iterable[str]) -> str:
    return ",".join(components) + "|" + ",".join(block_lists)


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = ""
    return out


@dataclass
class ModelCounts:
    """Everything the static estimate needs about one checkpoint's configs (JSON: `to_json` / `from_json`)."""

    config_hash: str
    versions: dict[str, str]
    components: dict[str, ComponentCounts]
    lora: dict[str, tuple[AdapterGroup, ...]] = field(default_factory=dict)
    fsdp: dict[str, FsdpGroups] = field(default_factory=dict)
    unresolved: tuple[str, ...] = ()  # model_index entries whose class is not importable: not counted

    def parameters(self, names: Iterable[str] | None = None) -> int:
        chosen = self.components if names is None else {n: self.components[n] for n in names}
        return sum(c.parameters for c in chosen.values())

    def adapters(self, components: Iterable[str], targets: Iterable[str]) -> tuple[AdapterGroup, ...]:
        key = lora_key(components, targets)
        if key not in self.lora:
            raise KeyError(f"no LoRA counts for {key!r} (have {sorted(self.lora)})")
        return self.lora[key]

    def fsdp_groups(self, components: Iterable[str], block_lists: Iterable[str]) -> FsdpGroups:
        return self.fsdp[fsdp_key(components, block_lists)]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "config_hash": self.config_hash,
            "versions": dict(self.versions),
            "components": {
                name: {
                    "library": c.library,
                    "class_name": c.class_name,
                    "tensors": [list(asdict(t).values()) for t in c.tensors],
                }
                for name, c in sorted(self.components.items())
            },
            "lora": {key: [list(asdict(a).values()) for a in groups] for key, groups in sorted(self.lora.items())},
            "fsdp": {
                key: {"blocks": [list(b) for b in g.blocks], "root": g.root} for key, g in sorted(self.fsdp.items())
            },
            "unresolved": list(self.unresolved),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelCounts:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"counts schema {data.get('schema')!r}, expected {SCHEMA}")
        components = {
            name: ComponentCounts(c["library"], c["class_name"], tuple(TensorGroup(*row) for row in c["tensors"]))
            for name, c in data["components"].items()
        }
        lora = {key: tuple(AdapterGroup(*row) for row in rows) for key, rows in data.get("lora", {}).items()}
        fsdp = {
            key: FsdpGroups(tuple((int(n), int(k)) for n, k in g["blocks"]), int(g["root"]))
            for key, g in data.get("fsdp", {}).items()
        }
        unresolved = tuple(data.get("unresolved", ()))
        return cls(str(data["config_hash"]), dict(data["versions"]), components, lora, fsdp, unresolved)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":")) + "\n"
