"""The run's output directory: resolved config, metrics.jsonl, images, rollouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.export import to_json_dict, to_yaml_text
from miles.utils.atomic import atomic_write_text

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def prepare_output_dir(resolved: ResolvedJob) -> Path:
    """Create `--output-dir` and write `config.yaml` (re-runnable via --custom-config-path) and `config.json`."""
    out = Path(resolved.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", to_yaml_text(resolved.args))
    atomic_write_text(
        out / "config.json", json.dumps(to_json_dict(resolved.spec.name, resolved.trainer_args), indent=2)
    )
    return out


def prepare_inputs(args: Any) -> None:
    """Build what the job starts from when it is missing (the embedded model, built-in data sets),
    here in the driver, with a progress bar, before any engine or trainer process needs it."""
    from miles.data.builtin import is_builtin_dataset, resolve_dataset
    from miles.models.checkpoints import ensure_checkpoint

    for checkpoint in {args.hf_checkpoint, getattr(args, "teacher_checkpoint", None)} - {None}:
        ensure_checkpoint(checkpoint)
    specs = [args.prompt_data, *(args.eval_prompt_data or {}).values()]
    for spec in specs:
        if spec is not None and is_builtin_dataset(spec):
            resolve_dataset(spec)


def export_final(args: Any, group: Any, what: str = "trained") -> Path:
    """Rank 0 of `group` writes the trained pipeline to `<output-dir>/checkpoint` (loadable with
    `from_pretrained`); every training job ends with it."""
    target = Path(args.output_dir) / "checkpoint"
    group.call("export_pipeline", str(target))
    print(f"miles: exported the {what} pipeline to {target}")
    return target
