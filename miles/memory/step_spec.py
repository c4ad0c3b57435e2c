"""`StepSpec`: everything the trace of one DiT forward depends on (torch-free; `miles.memory.step` caches the
traces, `miles.memory.activations` makes them)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

TRACE_FORMAT = 1


@dataclass(frozen=True)
class StepSpec:
    family: str
    components: tuple[str, ...]
    batch: int  # rows of the micro-batch (before CFG doubles them)
    latent: tuple[int, ...]  # one sample's latent
    conditions: tuple[tuple[str, tuple[int, ...] | None, str | None], ...]
    forward_dtype: str  # torch dtype name, e.g. "bfloat16"
    cfg: bool  # the guided forward (positive and negative branches)
    grad: bool  # forward + backward (the trainer); else a no-grad forward (the engine)
    gradient_checkpointing: bool
    lora: tuple[int, int, tuple[str, ...]] | None  # rank, alpha, targets
    timestep: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepSpec:
        lora = data.get("lora")
        return cls(
            family=str(data["family"]),
            components=tuple(data["components"]),
            batch=int(data["batch"]),
            latent=tuple(int(x) for x in data["latent"]),
            conditions=tuple(
                (str(n), None if s is None else tuple(int(x) for x in s), d) for n, s, d in data["conditions"]
            ),
            forward_dtype=str(data["forward_dtype"]),
            cfg=bool(data["cfg"]),
            grad=bool(data["grad"]),
            gradient_checkpointing=bool(data["gradient_checkpointing"]),
            lora=None if lora is None else (int(lora[0]), int(lora[1]), tuple(lora[2])),
            timestep=float(data["timestep"]),
        )

    def key(self, digest: str, versions: Mapping[str, str] | None = None) -> str:
        """The cache key: the spec and the configs' hash (and, for the user's cache, the library versions the
        forward depends on; the shipped `traces.json` is keyed without them: a registry release must not make
        `miles plan` trace, and each record says which versions traced it)."""
        parts: list[Any] = [TRACE_FORMAT, digest, self.to_json()]
        if versions is not None:
            parts.append(dict(sorted(versions.items())))
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]

    def describe(self) -> str:
        rows = self.batch * (2 if self.cfg else 1)
        parts = [f"{rows} x {'x'.join(map(str, self.latent))}"]
        if self.cfg:
            parts.append("CFG")
        parts.append("fwd+bwd" if self.grad else "no-grad fwd")
        if self.grad:
            parts.append("grad ckpt" if self.gradient_checkpointing else "no grad ckpt")
        if self.lora:
            parts.append(f"LoRA r{self.lora[0]}")
        return ", ".join(parts)
