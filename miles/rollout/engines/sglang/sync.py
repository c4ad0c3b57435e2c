"""Weight sync to sglang engines: what is written to disk and what the engines must then hold.

Full weights go through `/update_weights_from_disk`: the state dict is written (atomically) as
`<root>/v<version>/transformer/diffusion_pytorch_model.safetensors`, the layout that endpoint reads.
LoRA goes through `/v1/set_lora` as a diffusers-format adapter file
(`transformer.<module>.lora_A.weight` / `.lora_B.weight`, the layout `save_lora_weights` writes), with
peft's scaling given as `lora_alpha` (scaling * rank).

Verification is per tensor, through the server's `/update_weights_from_tensor_checker`: SHA-256 over
dtype, shape and bytes of every tensor, which the engine recomputes on its live weights. After a full
update every tensor must equal what the trainer sent. With LoRA set, sglang wraps every linear layer
(`<module>.base_layer.weight`) and keeps the adapter apart from the base weights, so the check covers the
frozen base weights under their wrapped names, and the active adapter is read back from `/v1/list_loras`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
KEEP_VERSIONS = 2


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The checker's digest: dtype, shape, then the raw bytes."""
    import torch

    t = tensor.detach().cpu().contiguous()
    hasher = hashlib.sha256()
    hasher.update(str(t.dtype).encode("utf-8"))
    hasher.update(repr(tuple(t.shape)).encode("utf-8"))
    hasher.update(t.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def expected_sha256(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, str]:
    return {name: tensor_sha256(t.to(dtype)) for name, t in state.items()}


def lora_wrapped_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the name sglang gives it once LoRA layers wrap the linears (2-D weights and their biases)."""
    linear = {name[: -len(".weight")] for name, t in state.items() if name.endswith(".weight") and t.dim() == 2}
    out = {}
    for name in state:
        prefix, _, leaf = name.rpartition(".")
        out[name] = f"{prefix}.base_layer.{leaf}" if prefix in linear else name
    return out


def write_transformer(state: dict[str, torch.Tensor], root: Path, version: int, dtype: torch.dtype) -> Path:
    """Write the weights for `/update_weights_from_disk`; returns the model path to send."""
    from safetensors.torch import save_file

    final = root / f"v{version}"
    tmp = root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "transformer").mkdir(parents=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}
    save_file(tensors, str(tmp / "transformer" / WEIGHTS_FILE))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _prune(root, "v", version)
    return final


def write_lora_adapter(payload: dict[str, torch.Tensor], root: Path, version: int) -> tuple[Path, int]:
    """Write `miles.models.lora_sync`'s payload as a diffusers-format adapter; (path, lora_alpha).

    sglang scales an adapter by lora_alpha / rank, one alpha per adapter, given as an integer. When
    peft's scaling is not one integer alpha for every module, the scaling is folded into lora_B and
    alpha = rank."""
    from safetensors.torch import save_file

    modules = sorted(name[: -len(".lora_A")] for name in payload if name.endswith(".lora_A"))
    if not modules:
        raise ValueError("the LoRA payload holds no lora_A tensors")
    ranks = {int(payload[f"{m}.lora_A"].shape[0]) for m in modules}
    alphas = {float(payload[f"{m}.lora_scaling"]) * int(payload[f"{m}.lora_A"].shape[0]) for m in modules}
    fold = len(alphas) != 1 or len(ranks) != 1 or not float(next(iter(alphas))).is_integer()
    tensors: dict[str, Any] = {}
    for m in modules:
        a = payload[f"{m}.lora_A"].detach().float().cpu().contiguous()
        b = payload[f"{m}.lora_B"].detach().float().cpu()
        if fold:
            b = b * float(payload[f"{m}.lora_scaling"])
        tensors[f"transformer.{m}.lora_A.weight"] = a
        tensors[f"transformer.{m}.lora_B.weight"] = b.contiguous()
    alpha = next(iter(ranks)) if fold else int(next(iter(alphas)))
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


def transformer_param_names(checkpoint: str | Path) -> frozenset[str]:
    """Parameter names of the checkpoint's transformer (built on the meta device: no weights read).

    The checker compares parameters only; a state dict also holds buffers (SD3's `pos_embed.pos_embed`)."""
    import json

    import diffusers
    import torch

    config_path = Path(checkpoint) / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        model = cls.from_config(config)
    return frozenset(name for name, _ in model.named_parameters())
