"""`miles export CHECKPOINT_DIR`: a saved checkpoint (`--save`) as the files a user loads anywhere.

The checkpoint holds the trained weights only (the LoRA tensors, or the whole denoiser of a full fine-tune), under
the training model's names. The job's config says what to build them onto: the base model (`--hf-checkpoint`), the
family, the LoRA rank, alpha and targets, the master dtype. The model is rebuilt here on the CPU exactly as a
trainer rank builds it (no Ray, no process group), the checkpoint is loaded into it, and the same writers as the
periodic exports (`miles.training.export`) write the adapter and the merged pipeline, each atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles.core.errors import ConfigError

WEIGHTS = ("live", "ema")


@dataclass
class CheckpointExport:
    """What `export_checkpoint` wrote: the checkpoint step, and the folder of each part."""

    step: int
    out: Path
    parts: dict[str, Path] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def trained_state(
    args: Any, family: Any, ckpt_dir: str | os.PathLike, ckpt_step: int | None, weights: str
) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    """(step, the full state of the trained denoiser with its LoRA layers under peft's names, the warnings about
    damaged checkpoints passed over).

    `weights` "ema" puts the EMA shadow (`ema.pt`) in place of the live weights, as `--ema-rollout-policy ema` does
    for what the engines serve."""
    from miles.training.checkpoint import read_checkpoint
    from miles.training.model import apply_lora, full_state_dict, load_transformer

    names = ["model.pt", "ema.pt"] if weights == "ema" else ["model.pt"]
    where = str(ckpt_dir)
    try:
        choice, parts = read_checkpoint(ckpt_dir, ckpt_step, names, where=where)
    except ConfigError as exc:
        if weights == "ema" and "ema.pt" in str(exc):
            raise ConfigError(
                f"--weights ema: checkpoint {ckpt_dir} has no ema.pt (the job did not train with --use-ema)"
            ) from None
        raise
    torch.manual_seed(args.seed)
    model = load_transformer(args, family)
    if args.use_lora:
        model = apply_lora(model, args, family)
    _load_into(model, parts["model.pt"], args, choice.path)
    if weights == "ema":
        _copy_ema(model, parts["ema.pt"], choice.path)
    return choice.step, full_state_dict(model), choice.warnings


def _load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], args: Any, where: Path) -> None:
    """The checkpoint's tensors into the rebuilt model: every one must have a place, and the trained ones all
    come from the checkpoint. A mismatch means the config does not describe the job that saved it."""
    hint = "check --hf-checkpoint, --use-lora, --lora-rank and --lora-target-modules against the job that saved it"
    own = model.state_dict()
    extra = [k for k in state if k not in own]
    if extra:
        raise ConfigError(
            f"{where}: {len(extra)} weight(s) of the checkpoint have no place in the model the config describes "
            f"(e.g. {extra[0]}); {hint}"
        )
    wrong = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        k = wrong[0]
        raise ConfigError(
            f"{where}: {k} is {tuple(state[k].shape)} in the checkpoint but {tuple(own[k].shape)} in the model "
            f"the config describes; {hint}"
        )
    needed = [k for k in own if "lora_" in k] if args.use_lora else list(own)
    missing = [k for k in needed if k not in state]
    if missing:
        raise ConfigError(
            f"{where}: the checkpoint lacks {len(missing)} trained weight(s) of the model the config describes "
            f"(e.g. {missing[0]}); {hint}"
        )
    model.load_state_dict(state, strict=False)


def _copy_ema(model: torch.nn.Module, ema: dict[str, Any], where: Path) -> None:
    params = dict(model.named_parameters())
    shadow = ema.get("shadow") or {}
    missing = [name for name in shadow if name not in params]
    if missing or not shadow:
        raise ConfigError(f"{where}/ema.pt: its weights do not match the model the config describes")
    with torch.no_grad():
        for name, value in shadow.items():
            params[name].copy_(value.to(params[name].dtype))


def export_checkpoint(
    args: Any,
    ckpt_dir: str | os.PathLike,
    *,
    ckpt_step: int | None = None,
    out: str | os.PathLike | None = None,
    merged: bool = False,
    weights: str = "live",
    comfyui: bool = False,
) -> CheckpointExport:
    """Write `out` (default `<ckpt_dir>/exports/iter_<step>/`): `lora/` under --use-lora, `pipeline/` with
    `merged` or for a full fine-tune, and with `comfyui` the adapter as ComfyUI loads it (`comfyui/`). A part
    already there is replaced only once its new copy is whole."""
    from miles.training.export import export_lora, export_pipeline
    from miles.training.export_comfyui import check_comfyui, write_comfyui_lora
    from miles.training.model import family_of, merged_base_state_dict

    if weights not in WEIGHTS:
        raise ConfigError(f"--weights {weights}: expected live or ema")
    if merged and not args.use_lora:
        raise ConfigError("--merged: this job trained the full model, whose export is the merged pipeline already")
    family = family_of(args)
    if comfyui and not args.use_lora:
        raise ConfigError("--comfyui writes a LoRA file: this job trained the full model (its export is the pipeline)")
    if comfyui:
        check_comfyui(family)
    step, state, warnings = trained_state(args, family, ckpt_dir, ckpt_step, weights)
    target = Path(out) if out is not None else Path(ckpt_dir) / "exports" / f"iter_{step:07d}"
    result = CheckpointExport(step=step, out=target, warnings=list(warnings))
    if args.use_lora:
        result.parts["lora"] = export_lora(args, family, state, target / "lora")
    if comfyui:
        result.parts["comfyui"] = write_comfyui_lora(family, target / "lora", target / "comfyui", args.lora_alpha)
    if merged or not args.use_lora:
        served = merged_base_state_dict(state, args) if args.use_lora else state
        result.parts["pipeline"] = export_pipeline(args, family, served, target / "pipeline")
    return result
