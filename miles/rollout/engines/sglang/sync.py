"""Weight sync to sglang engines: what is written to disk and what the engines must then hold.

Full weights go through `/update_weights_from_disk`: the state dict is written (atomically) as
`<root>/v<version>/transformer/diffusion_pytorch_model.safetensors`, the layout that endpoint reads, in
shards of at most `--update-weight-buffer-size` bytes (with diffusers' index file) when it is larger.
LoRA goes through `/v1/set_lora` as a diffusers-format (peft key style) adapter file, with peft's
scaling given as `lora_alpha` (scaling * rank).

Verification is per tensor, through the server's `/update_weights_from_tensor_checker`: SHA-256 over
dtype, shape and bytes of every tensor, which the engine recomputes on its live weights. After a full
update every tensor must equal what the trainer sent. With LoRA set, sglang wraps every linear module
(`<module>.base_layer.weight`) and, in merge mode, leaves `base + alpha/rank * B @ A` there (fp32 math),
so the check covers every parameter, the adapted ones with the merge recomputed here, bit for bit;
the active adapter is read back from `/v1/list_loras` too.

sglang's SD3 port matches adapter keys without the `transformer.` prefix that diffusers'
`save_lora_weights` writes (with it, set_lora answers 200 and applies the adapter to 0 layers), so the
keys are `<module>.lora_A.weight` / `<module>.lora_B.weight`.

Where sglang's port of a family's DiT fuses modules (Qwen-Image's text q/k/v into `to_added_qkv`), the
digests are of its layout: the family's `to_engine_tensors` / `engine_module` (`sglang_fused_modules`)
say how, and a LoRA merge is computed per member, then concatenated, as sglang merges stacked sections.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from miles.models.pipeline_config import TrainPipelineConfig

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
KEEP_VERSIONS = 2


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The checker's digest: dtype, shape, then the raw bytes."""
    import torch

    t = tensor.detach().cpu().contiguous()
    hasher = hashlib.sha256()
    hasher.update(str(t.dtype).encode("utf-8"))
    hasher.update(repr(tuple(t.shape)).encode("utf-8"))
    hasher.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # flat: a 0-dim tensor has bytes too
    return hasher.hexdigest()


def expected_sha256(
    state: dict[str, torch.Tensor], dtype: torch.dtype, family: TrainPipelineConfig | None = None
) -> dict[str, str]:
    """Digests of `state` (sglang's names) cast to `dtype`, the DiT precision; a tensor the family's port keeps
    in another dtype (`engine_dtype`: cosmos3's fp32 time embedder) holds that cast widened to it."""
    if family is None:
        return {name: tensor_sha256(t.to(dtype)) for name, t in state.items()}
    return {name: tensor_sha256(t.to(dtype).to(family.engine_dtype(name, dtype))) for name, t in state.items()}


def lora_wrapped_names(names: Any, linears: Any) -> dict[str, str]:
    """name -> the name sglang gives it once LoRA layers wrap the linear modules `linears`
    (`<module>.weight` -> `<module>.base_layer.weight`, biases likewise)."""
    out = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        out[name] = f"{prefix}.base_layer.{leaf}" if prefix in linears else name
    return out


def merged_lora_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """What sglang's merge leaves in a wrapped linear: `base + scale * (B @ A)`, in fp32, in base's dtype."""
    data = base.float().clone()
    data.add_(b.float() @ a.float(), alpha=scale)
    return data.to(base.dtype)


def engine_sha256(
    state: dict[str, torch.Tensor], dtype: torch.dtype, family: TrainPipelineConfig | None = None
) -> dict[str, str]:
    """`expected_sha256` in the layout sglang's port of `family`'s DiT holds the tensors (None: as named)."""
    return expected_sha256(family.to_engine_tensors(state) if family is not None else state, dtype, family)


def cast_kept_modules(
    state: dict[str, torch.Tensor], dtype: torch.dtype, family: TrainPipelineConfig | None = None
) -> dict[str, torch.Tensor]:
    """`state` with the tensors of the modules the family's port keeps in another dtype (`engine_dtype`) cast to
    `dtype` first: sent by handle they then hold what a written shard gives them (what the digests expect)."""
    if family is None or not getattr(family, "sglang_fp32_modules", ()):
        return state
    out = dict(state)
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        engine = family.engine_module(module)[0]
        if engine and family.engine_dtype(f"{engine}.{leaf}", dtype) != dtype and tensor.is_floating_point():
            out[name] = tensor.to(dtype)
    return out


def files_engine_sha256(
    files: list[Path], names: Any, dtype: torch.dtype, family: TrainPipelineConfig | None = None
) -> dict[str, str]:
    """`engine_sha256` of the tensors `names` stored in the safetensors `files`, one file in memory at a time
    (the members of fused modules are kept, in `dtype`, until their module is whole)."""
    from safetensors.torch import load_file

    digests: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = {k: v for k, v in load_file(str(file)).items() if k in names}
        if family is not None:
            fused = {k for k in tensors if len(family.engine_module(k.rpartition(".")[0])[1]) > 1}
            pending.update({k: tensors.pop(k).to(dtype) for k in fused})
            tensors = family.to_engine_tensors(tensors)  # sglang's names (Wan's port renames modules)
        digests.update(expected_sha256(tensors, dtype, family))
    if pending:
        digests.update(engine_sha256(pending, dtype, family))
    return digests


def lora_expected_sha256(
    base_files: list[Path],
    base_sha: dict[str, str],
    adapter: Path,
    alpha: int,
    linears: Any,
    dtype: torch.dtype,
    family: TrainPipelineConfig | None = None,
) -> dict[str, str]:
    """Every transformer parameter after `/v1/set_lora` of `adapter` (merge mode) on the weights in
    `base_files` (digests `base_sha`, in sglang's layout), under sglang's wrapped names: the adapted
    linears hold the merge, everything else the base."""
    from safetensors.torch import load_file

    lora = load_file(str(adapter))
    modules = sorted(k[: -len(".lora_A.weight")] for k in lora if k.endswith(".lora_A.weight"))
    pairs = {m: (lora[f"{m}.lora_A.weight"], lora[f"{m}.lora_B.weight"]) for m in modules}
    return lora_merged_sha256(base_files, base_sha, pairs, alpha, linears, dtype, source=str(adapter), family=family)


def lora_merged_sha256(
    base_files: list[Path],
    base_sha: dict[str, str],
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: int,
    linears: Any,
    dtype: torch.dtype,
    source: str = "the LoRA payload",
    family: TrainPipelineConfig | None = None,
) -> dict[str, str]:
    """`lora_expected_sha256` for adapter pairs `module -> (A, B)` as sglang receives them (a file's, or
    `/update_weights_from_tensor`'s `lora_merge` payload, which merges the same way). With a `family`
    whose sglang port fuses modules, an adapted member's fused module is recomputed from all members."""
    from safetensors import safe_open

    from miles.models.pipeline_config import TrainPipelineConfig

    adapter = family if family is not None else TrainPipelineConfig()
    members = {m for module in pairs for m in adapter.engine_module(module)[1]}
    wanted = {f"{m}.weight": m for m in members}
    weights: dict[str, torch.Tensor] = {}
    for file in base_files:
        with safe_open(str(file), framework="pt") as handle:
            for name in wanted.keys() & set(handle.keys()):
                weight = handle.get_tensor(name).to(dtype)
                if wanted[name] in pairs:
                    a, b = pairs[wanted[name]]
                    weight = merged_lora_weight(weight, a, b, alpha / a.shape[0])
                weights[name] = weight
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ValueError(f"LoRA adapter {source} adapts modules the transformer does not have: {missing[:5]}")
    merged = expected_sha256(adapter.to_engine_tensors(weights), dtype, family)
    digests = {**base_sha, **merged}
    wrapped = lora_wrapped_names(digests, lora_wrapped_modules(linears, adapter))
    return {wrapped[name]: digest for name, digest in digests.items()}


def lora_wrapped_modules(linears: Any, family: TrainPipelineConfig | None = None) -> set[str]:
    """The linear modules (diffusers' names) sglang wraps in LoRA layers, under its names: all of them but
    those whose name holds one of the family's `sglang_lora_excluded` parts (sglang's `exclude_lora_layers`:
    Wan's embedders)."""
    from miles.models.pipeline_config import TrainPipelineConfig

    adapter = family if family is not None else TrainPipelineConfig()
    excluded = tuple(getattr(adapter, "sglang_lora_excluded", ()))
    names = {adapter.engine_module(m)[0] for m in linears}
    return {name for name in names if name and not any(part in name for part in excluded)}


# ---- experts: one served module per sync target (Wan2.2's transformer and transformer_2) ---------------
def sync_targets(family: TrainPipelineConfig | None = None) -> tuple[str, ...]:
    """The pipeline modules a sync writes, loads and verifies (`weight_sync_targets`; SD3's one transformer)."""
    return tuple(family.weight_sync_targets) if family is not None else ("transformer",)


def split_targets(state: dict[str, Any], targets: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """A trainer state dict (or LoRA payload) -> its tensors per sync target, named as in that module. One
    target: the names are already the module's. Several (experts): each name starts with `<target>.`."""
    if len(targets) == 1:
        return {targets[0]: dict(state)}
    out: dict[str, dict[str, Any]] = {t: {} for t in targets}
    for name, tensor in state.items():
        target, _, rest = name.partition(".")
        if target not in out or not rest:
            raise KeyError(f"{name!r} belongs to no synced module {targets}")
        out[target][rest] = tensor
    return {t: tensors for t, tensors in out.items() if tensors}


def write_expert_weights(
    state: dict[str, torch.Tensor],
    root: Path,
    version: int,
    dtype: torch.dtype,
    targets: tuple[str, ...],
    buffer_bytes: int | None = None,
) -> tuple[Path, tuple[str, ...]]:
    """`write_transformer` for several targets: `<root>/v<version>/<target>/` per target the state holds, each
    in shards of at most `buffer_bytes` (`/update_weights_from_disk` reads that layout); (model path, the
    targets)."""
    parts = split_targets(state, targets)
    final = root / f"v{version}"
    tmp = root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for target, tensors in parts.items():
        write_shards(tensors, tmp / target, dtype, buffer_bytes)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _prune(root, "v", version)
    return final, tuple(parts)


def write_expert_lora_adapters(
    payload: dict[str, torch.Tensor], root: Path, version: int, targets: tuple[str, ...]
) -> dict[str, tuple[Path, int]]:
    """`write_lora_adapter` per target: `<root>/lora_v<version>/<target>.safetensors` (module names without
    the target), each with its own `lora_alpha`; {target: (path, alpha)} for the targets the payload adapts."""
    from safetensors.torch import save_file

    final = root / f"lora_v{version}"
    tmp = root / f".lora_v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    alphas: dict[str, int] = {}
    for target, part in split_targets(payload, targets).items():
        pairs, alphas[target] = lora_adapter_pairs(part)
        tensors: dict[str, Any] = {}
        for m, (a, b) in pairs.items():
            tensors[f"{m}.lora_A.weight"] = a.detach().float().cpu().contiguous()
            tensors[f"{m}.lora_B.weight"] = b.detach().float().cpu().contiguous()
        save_file(tensors, str(tmp / f"{target}.safetensors"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _prune(root, "lora_v", version)
    return {t: (final / f"{t}.safetensors", alpha) for t, alpha in alphas.items()}


def disk_update_body(model_path: str, targets: tuple[str, ...] = ("transformer",)) -> dict[str, Any]:
    """The `/update_weights_from_disk` body: every target's subfolder of `model_path`, loaded at once."""
    return {"model_path": model_path, "target_modules": list(targets)}


def set_lora_body(adapters: dict[str, tuple[str, int]], nickname: str) -> dict[str, Any]:
    """The `/v1/set_lora` body (merge mode) for `{target: (adapter path, lora_alpha)}`: one adapter on the
    transformer as before; with experts one nickname per target (`<nickname>-<target>`), sglang's lists."""
    if list(adapters) == ["transformer"]:
        path, alpha = adapters["transformer"]
        return {
            "lora_nickname": nickname,
            "lora_path": path,
            "target": "transformer",
            "merge_mode": "merge",
            "lora_alpha": int(alpha),
        }
    targets = list(adapters)
    return {
        "lora_nickname": [f"{nickname}-{t}" for t in targets],
        "lora_path": [adapters[t][0] for t in targets],
        "target": targets,
        "merge_mode": "merge",
        "lora_alpha": [int(adapters[t][1]) for t in targets],
    }


def checker_body(expected: dict[str, str], target: str = "transformer") -> dict[str, Any]:
    """The `/update_weights_from_tensor_checker` body for one module's digests (sglang's names)."""
    return {"target_module": target, "expected_named_tensors_sha256": expected}


def write_transformer(
    state: dict[str, torch.Tensor], root: Path, version: int, dtype: torch.dtype, buffer_bytes: int | None = None
) -> Path:
    """Write the weights for `/update_weights_from_disk` (in shards of at most `buffer_bytes`,
    `write_shards`); returns the model path to send."""
    final = root / f"v{version}"
    tmp = root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_shards(state, tmp / "transformer", dtype, buffer_bytes)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _prune(root, "v", version)
    return final


def shard_plan(state: dict[str, torch.Tensor], dtype: torch.dtype, buffer_bytes: int | None) -> list[list[str]]:
    """The names of `state` in shards of at most `buffer_bytes` once cast to `dtype`, in order (a larger tensor
    makes a shard alone; None: one shard)."""
    from miles.utils.buckets import cut_by_bytes

    return cut_by_bytes(((name, t.numel() * dtype.itemsize) for name, t in state.items()), buffer_bytes)


def write_shards(
    state: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype, buffer_bytes: int | None = None
) -> list[int]:
    """Write one module's tensors, cast to `dtype`, as `diffusion_pytorch_model.safetensors`, or, when they
    exceed `buffer_bytes` (`--update-weight-buffer-size`), as shards `diffusion_pytorch_model-0000k-of-0000n.
    safetensors` of at most that many bytes each with the index diffusers and sglang read
    (`diffusion_pytorch_model.safetensors.index.json`). One shard is cast and held at a time, and sglang's
    `/update_weights_from_disk` loads them one file at a time. Returns the bytes of tensor data per shard."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(state, dtype, buffer_bytes) or [[]]
    stem, _, suffix = WEIGHTS_FILE.partition(".")
    sizes: list[int] = []
    weight_map: dict[str, str] = {}
    for k, names in enumerate(plan, start=1):
        file = WEIGHTS_FILE if len(plan) == 1 else f"{stem}-{k:05d}-of-{len(plan):05d}.{suffix}"
        shard = {name: state[name].detach().to("cpu", dtype).contiguous() for name in names}
        save_file(shard, str(folder / file))
        sizes.append(sum(t.numel() * t.element_size() for t in shard.values()))
        weight_map.update(dict.fromkeys(names, file))
        del shard
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (folder / f"{WEIGHTS_FILE}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sizes


def lora_adapter_pairs(payload: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """`miles.models.lora_sync`'s payload as sglang takes an adapter: `module -> (A, B)` and one integer
    `lora_alpha`. sglang scales each module by lora_alpha / its rank; when peft's scalings do not come
    from one integer alpha, alpha = the largest rank and the rest of each module's scaling is folded into
    its B (a new tensor; otherwise A and B are the payload's own)."""
    modules = sorted(name[: -len(".lora_A")] for name in payload if name.endswith(".lora_A"))
    if not modules:
        raise ValueError("the LoRA payload holds no lora_A tensors")
    ranks = {int(payload[f"{m}.lora_A"].shape[0]) for m in modules}
    alphas = {float(payload[f"{m}.lora_scaling"]) * int(payload[f"{m}.lora_A"].shape[0]) for m in modules}
    fold = len(alphas) != 1 or not float(next(iter(alphas))).is_integer()
    alpha = max(ranks) if fold else int(next(iter(alphas)))
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in modules:
        a, b = payload[f"{m}.lora_A"], payload[f"{m}.lora_B"]
        if fold:  # sglang scales module m by alpha / rank_m: put the rest of peft's scaling into B
            b = b.float() * (float(payload[f"{m}.lora_scaling"]) * a.shape[0] / alpha)
        pairs[m] = (a, b)
    return pairs, alpha


def write_lora_adapter(payload: dict[str, torch.Tensor], root: Path, version: int) -> tuple[Path, int]:
    """Write `miles.models.lora_sync`'s payload as a diffusers-format adapter; (path, lora_alpha)
    (`lora_adapter_pairs` says how peft's scalings become one alpha)."""
    from safetensors.torch import save_file

    pairs, alpha = lora_adapter_pairs(payload)
    tensors: dict[str, Any] = {}
    for m, (a, b) in pairs.items():
        tensors[f"{m}.lora_A.weight"] = a.detach().float().cpu().contiguous()
        tensors[f"{m}.lora_B.weight"] = b.detach().float().cpu().contiguous()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"lora_v{version}.safetensors"
    tmp = root / f".lora_v{version}.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    _prune(root, "lora_v", version, suffix=".safetensors")
    return path, alpha


def _prune(root: Path, prefix: str, version: int, suffix: str = "") -> None:
    """Keep the newest KEEP_VERSIONS versions (a restarted engine replays the latest)."""
    for entry in root.iterdir():
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        number = name[len(prefix) : len(name) - len(suffix)] if suffix else name[len(prefix) :]
        if number.isdigit() and int(number) <= version - KEEP_VERSIONS:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def transformer_layout(
    checkpoint: str | Path, subfolder: str = "transformer"
) -> tuple[frozenset[str], frozenset[str]]:
    """(parameter names, names of its nn.Linear modules) of the checkpoint's transformer (or the module in
    `subfolder`, e.g. Wan2.2's `transformer_2`), built on the
    meta device (no weights read). The checker compares parameters only (a state dict also holds
    buffers, e.g. SD3's `pos_embed.pos_embed`), and sglang's LoRA wraps exactly the linear modules."""
    import json

    import diffusers
    import torch

    config_path = Path(checkpoint) / subfolder / "config.json"
    config = json.loads(config_path.read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        model = cls.from_config(config)
    params = frozenset(name for name, _ in model.named_parameters())
    linears = frozenset(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    return params, linears
