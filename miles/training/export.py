"""Exporting trained weights as a complete diffusers pipeline directory.

The export is the base pipeline (`--hf-checkpoint`) with the transformer replaced by the trained
one (LoRA merged), so it loads with `from_pretrained` and serves as `--hf-checkpoint` of a later
job (eval, or the start of RL from an SFT teacher). The other components are symlinks to the base
pipeline's. Written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from miles.core.inputs import input_path
from miles.utils.paths import atomic_directory


def local_pipeline_dir(checkpoint: str | os.PathLike) -> Path | None:
    """The local directory of a checkpoint: itself, or its copy in the Hugging Face cache (no download)."""
    path = Path(checkpoint)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(checkpoint), local_files_only=True))
    except Exception:
        return None


def export_pipeline(args: Any, family: Any, state: dict[str, torch.Tensor], out_dir: str | os.PathLike) -> Path:
    """The base pipeline with the trained transformer. The unchanged components are symlinks to the base
    (cheap for SD3.5-class models); when the base is not on this machine only the transformer is written."""
    from miles.models.loading import quiet_loading

    base = local_pipeline_dir(input_path(args, args.hf_checkpoint))
    out = Path(out_dir)
    parts = family.split_denoiser_state(state)  # {subfolder: its state}: one transformer, or the trained experts
    with atomic_directory(out, replace=True) as tmp:
        if base is not None:
            for entry in base.iterdir():
                if entry.name not in parts:
                    os.symlink(entry.resolve(), tmp / entry.name, target_is_directory=entry.is_dir())
        source = os.fspath(base) if base is not None else str(args.hf_checkpoint)
        for subfolder, part in parts.items():
            with quiet_loading():
                transformer = family.load_transformer_class().from_pretrained(source, subfolder=subfolder)
            missing, unexpected = transformer.load_state_dict(part, strict=False)
            if unexpected or missing:
                raise RuntimeError(
                    f"export: state does not fit the {subfolder} (missing {missing[:3]}, extra {unexpected[:3]})"
                )
            transformer.save_pretrained(tmp / subfolder)
    return out


def export_lora(args: Any, family: Any, state: dict[str, torch.Tensor], out_dir: str | os.PathLike) -> Path:
    """The trained LoRA in diffusers/peft format (`pytorch_lora_weights.safetensors` + its LoraConfig),
    loadable with `pipeline.load_lora_weights(out_dir)` (a pipeline without a LoRA loader, Cosmos3's:
    `pipeline.transformer.load_lora_adapter(out_dir, prefix="transformer", weight_name=
    "pytorch_lora_weights.safetensors")`). A family with experts gets one adapter per trained
    expert in `out_dir/<expert>/` (diffusers' Wan convention: `load_lora_weights(out_dir / "transformer_2",
    load_into_transformer_2=True)` for the low-noise one)."""
    from miles.training.model import lora_targets

    layers = {k.replace(".default", ""): v.contiguous() for k, v in state.items() if "lora_" in k}
    if not layers:
        raise ValueError("export_lora: the model has no LoRA weights (train with --use-lora)")
    metadata = {
        "r": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "target_modules": lora_targets(args, family),
        "init_lora_weights": True,
    }
    out = Path(out_dir)
    parts = family.split_denoiser_state(layers) if family.experts else {"": layers}
    pipeline_class = family.load_pipeline_class()
    with atomic_directory(out, replace=True) as tmp:
        for subfolder, part in parts.items():
            where = tmp / subfolder if subfolder else tmp
            if hasattr(pipeline_class, "save_lora_weights"):
                pipeline_class.save_lora_weights(
                    where, transformer_lora_layers=part, transformer_lora_adapter_metadata=metadata
                )
            else:  # a pipeline without a LoRA loader (Cosmos3): the same file, for `transformer.load_lora_adapter`
                from diffusers.loaders.lora_base import LoraBaseMixin

                LoraBaseMixin._save_lora_weights(
                    where, lora_layers={"transformer": part}, lora_metadata={"transformer": metadata}
                )
    return out
