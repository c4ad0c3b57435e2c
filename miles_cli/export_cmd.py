"""`miles export CHECKPOINT_DIR`: turn a saved checkpoint into a LoRA adapter and/or a merged pipeline.

    miles export runs/grpo/ckpt                         # the latest checkpoint; config: runs/grpo/ckpt/config.yaml
    miles export runs/grpo/ckpt --ckpt-step 40 --merged --out exports/grpo-40
    miles export old/ckpt --config runs/grpo/config.yaml --hf-checkpoint /models/sd35m
    miles export runs/wan/ckpt --comfyui                # also comfyui/wan2_2_<expert>_lora.safetensors

Torch-free at import; the model is built only when the export runs (`miles.training.export_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from miles.core.errors import ConfigError

CONFIG_FILE = "config.yaml"


def find_config(ckpt_dir: Path, given: str | None) -> str:
    """The job config an export rebuilds the model from: `--config`, else the `config.yaml` a training job writes
    into its `--save` folder, else the one beside it (a run's output dir holding `best/` or `ckpt/`)."""
    if given:
        return given
    for folder in (ckpt_dir, ckpt_dir.parent):
        if (folder / CONFIG_FILE).is_file():
            return str(folder / CONFIG_FILE)
    raise ConfigError(
        f"{ckpt_dir}: no {CONFIG_FILE} here or in its parent to say which model the checkpoint trains; give the "
        "job's config with --config FILE.yaml (the run's output dir has one) or a recipe name"
    )


def export(
    checkpoint_dir: Annotated[
        str, typer.Argument(metavar="CHECKPOINT_DIR", help="A --save folder of a training job.")
    ],
    ckpt_step: Annotated[
        Optional[int],  # noqa: UP045 - Typer reads the annotation at run time
        typer.Option("--ckpt-step", min=0, help="The checkpoint step; default: the latest complete one."),
    ] = None,
    config: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--config",
            metavar="FILE.yaml|RECIPE",
            help="The job's config (its run's config.yaml, or a recipe); default: CHECKPOINT_DIR/config.yaml, "
            "written by every training job with --save.",
        ),
    ] = None,
    hf_checkpoint: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--hf-checkpoint", metavar="PATH", help="The base model, where it is on this machine."),
    ] = None,
    merged: Annotated[
        bool, typer.Option("--merged", help="Also write the merged pipeline beside the LoRA adapter.")
    ] = False,
    comfyui: Annotated[
        bool,
        typer.Option(
            "--comfyui",
            help="Also write the adapter as ComfyUI loads it (comfyui/<family>_lora.safetensors: its module names, "
            "an alpha per module); sd3, flux, qwen_image, wan2_2 (one file per expert) and ltx.",
        ),
    ] = False,
    weights: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--weights",
            metavar="live|ema",
            help="The live weights or the EMA copy (ema.pt); default: what the job's engines served "
            "(--ema-rollout-policy).",
        ),
    ] = None,
    out: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--out", metavar="DIR", help="Where to write; default: CHECKPOINT_DIR/exports/iter_<step>/."),
    ] = None,
) -> None:
    """Turn a saved checkpoint into a LoRA adapter (diffusers format) and/or a merged pipeline."""
    from miles.config.resolve import resolve
    from miles.training.checkpoint_index import find_loadable_checkpoint

    ckpt = Path(checkpoint_dir)
    find_loadable_checkpoint(ckpt, ckpt_step, verify="size", where=str(ckpt))  # missing or damaged: one line, now
    source = find_config(ckpt, config)
    cli = {"hf_checkpoint": hf_checkpoint} if hf_checkpoint else {}
    resolved = resolve(None, cli=cli, recipe=source)
    job = resolved.spec
    if not job.saves_checkpoints:
        raise ConfigError(f"{source}: a `miles {resolved.spec.command}` config; an export needs a training job's")
    if job.distills and ckpt.name == "critic":
        raise ConfigError(f"{ckpt}: the DMD2 critic (fake score); the student's checkpoints are in {ckpt.parent}")
    args = resolved.trainer_args["actor"]
    chosen = weights or args.ema_rollout_policy
    _check_base(args)
    print(f"miles: exporting {ckpt} with the config {source}", flush=True)
    from miles.training.export_checkpoint import export_checkpoint

    result = export_checkpoint(
        args, ckpt, ckpt_step=ckpt_step, out=out, merged=merged, weights=chosen, comfyui=comfyui
    )
    for warning in result.warnings:
        print(f"miles: warning: {warning}")
    shown = " and ".join(f"{name} ({path})" for name, path in result.parts.items())
    print(f"miles: exported step {result.step} ({chosen} weights): {shown}")


def _check_base(args: Any) -> None:
    from miles.core.inputs import input_path
    from miles.training.export import local_pipeline_dir

    base = input_path(args, args.hf_checkpoint)
    if base is None or local_pipeline_dir(base) is None:
        raise ConfigError(
            f"--hf-checkpoint {args.hf_checkpoint}: the base model is not on this machine (give --hf-checkpoint PATH)"
        )
