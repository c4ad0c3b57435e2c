"""The LoRA file ComfyUI loads (`miles export --comfyui`), converted from the diffusers adapter an export wrote.

ComfyUI takes `<module>.lora_A.weight` / `<module>.lora_B.weight` pairs under the module names its own model uses,
and scales each pair by `<module>.alpha` / rank (1 when there is no alpha: it does not read the adapter's metadata).
So the file keeps the A and B tensors as they are, renames the modules through the family
(`TrainPipelineConfig.comfyui_lora_module`: diffusers' names for SD3, Flux and Qwen-Image, the original checkpoint's
for Wan and LTX-2) and adds every module's alpha (`--lora-alpha`), so ComfyUI applies alpha / rank as peft did.
A family with experts gets one file per expert adapter (Wan2.2: `transformer` is the high-noise expert,
`transformer_2` the low-noise one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from miles.core.errors import ConfigError

ADAPTER_FILE = "pytorch_lora_weights.safetensors"


def comfyui_state(family: Any, adapter: dict[str, torch.Tensor], lora_alpha: float) -> dict[str, torch.Tensor]:
    """The diffusers adapter's tensors under ComfyUI's names, with an `.alpha` per module."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in adapter.items():
        module, sep, suffix = key.rpartition(".lora_")
        if not sep:
            raise ValueError(f"{key}: not a LoRA tensor of a diffusers adapter")
        try:
            name = family.comfyui_lora_module(module)
        except ValueError as exc:
            raise ConfigError(f"--comfyui: {exc}") from None
        out[f"{name}.lora_{suffix}"] = tensor.contiguous()
        out.setdefault(f"{name}.alpha", torch.tensor(float(lora_alpha)))
    return out


def check_comfyui(family: Any) -> None:
    """ConfigError when ComfyUI has no model for the family (before anything is built or written)."""
    if not family.comfyui_lora:
        raise ConfigError(f"--comfyui: {family.comfyui_lora_missing}; use the diffusers adapter (lora/)")


def write_comfyui_lora(
    family: Any, lora_dir: str | os.PathLike, out_dir: str | os.PathLike, lora_alpha: float
) -> Path:
    """`out_dir/<family>_lora.safetensors` (experts: `<family>_<expert>_lora.safetensors`) from the diffusers adapter
    files under `lora_dir`; written atomically."""
    from safetensors.torch import load_file, save_file

    from miles.utils.paths import atomic_directory

    check_comfyui(family)
    sources = sorted(Path(lora_dir).rglob(ADAPTER_FILE))
    if not sources:
        raise ConfigError(f"--comfyui: no {ADAPTER_FILE} under {lora_dir}")
    with atomic_directory(Path(out_dir), replace=True) as tmp:
        for source in sources:
            expert = source.parent.relative_to(lora_dir).as_posix()
            name = f"{family.name}_{expert}_lora" if expert != "." else f"{family.name}_lora"
            state = comfyui_state(family, load_file(source), lora_alpha)
            save_file(state, tmp / f"{name}.safetensors", metadata={"format": "pt", "miles_family": family.name})
    return Path(out_dir)
