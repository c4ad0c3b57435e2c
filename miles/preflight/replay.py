"""Rollout files a job trains on: `miles replay ROLLOUT.pt`, or `train rl --load-debug-rollout-data TEMPLATE`.

Each file the run will read must exist; the first is loaded (`miles.io.rollout_file.load_rollout`, so this check
imports torch, and only for these jobs): it must hold samples (an empty rollout trains nothing), survive
`--load-debug-rollout-data-subsample`, and have been made with the job's model: a file that records its model
(`extra["model"]`) is refused when the family or a denoiser shape differs from the job's `--hf-checkpoint`.
An older file without the record is not compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.errors import ConfigError
from miles.utils.text import clip

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

REPLAY_LABEL = "ROLLOUT.pt"
TEMPLATE_FLAG = "--load-debug-rollout-data"


def _rollout_ids(args: Any) -> range:
    """The rollout ids `train rl` reads from the template: from the resumed (or --start-rollout-id) one on."""
    end = int(args.num_rollout or 1)
    if args.start_rollout_id is not None:
        return range(int(args.start_rollout_id), end)
    if args.load is None:
        return range(0, end)
    from miles.training.checkpoint_index import find_loadable_checkpoint

    try:
        folder = find_loadable_checkpoint(args.load, args.ckpt_step).path
        start = int(json.loads((folder / "extra.json").read_text(encoding="utf-8"))["rollout_id"]) + 1
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        start = end - 1  # the --load check names the problem; look at the last file only
    return range(max(0, start), end)


def _format(template: str, rollout_id: int) -> Path:
    from miles.io.rollout_file import format_rollout_path

    return format_rollout_path(template, rollout_id)


def check_rollout_files(resolved: ResolvedJob) -> list[str]:
    args = resolved.trainer_args.get("actor", resolved.args)
    template = args.load_debug_rollout_data
    if template is None:
        return []
    if resolved.spec.name == "replay":
        label, paths = REPLAY_LABEL, [Path(str(template)).expanduser()]
    else:
        label = TEMPLATE_FLAG
        ids = _rollout_ids(args)
        paths = [_format(str(template), rid) for rid in ids]
        missing = [(rid, p) for rid, p in zip(ids, paths, strict=True) if not p.is_file()]
        if missing:
            shown = ", ".join(str(rid) for rid, _ in missing[:8]) + (", ..." if len(missing) > 8 else "")
            return [
                f"{label} {template}: {len(missing)} of the {len(paths)} rollout files the run reads are missing "
                f"(rollout ids {shown}; first: {clip(str(missing[0][1]), 160)}); save them with "
                "`--save-debug-rollout-data` (or `miles rollout-only`), or lower --num-rollout"
            ]
    if not paths:
        return []
    problem = rollout_file_problem(paths[0], args)
    return [f"{label} {problem}"] if problem else []


def rollout_file_problem(path: Path, args: Any) -> str | None:
    """What is wrong with one rollout file for this job (None: it can be trained on)."""
    from miles.io.rollout_file import load_rollout, rollout_model, subsample_rollout
    from miles.models.model_record import describe_record, model_record_of, record_differences

    try:
        rollout_id, samples, extra = load_rollout(path)
    except ConfigError as exc:
        return str(exc)
    if not samples:
        return (
            f"{path}: rollout {rollout_id} holds no samples, so there is nothing to train on; "
            "replay a rollout that has samples"
        )
    if args.load_debug_rollout_data_subsample:
        try:
            subsample_rollout(samples, args.load_debug_rollout_data_subsample, group_size=args.n_samples_per_prompt)
        except (ConfigError, ValueError) as exc:
            return f"{path}: {exc}"
    made_with = rollout_model(extra)
    current = model_record_of(args)
    if made_with is None or current is None:
        return None  # an older file (no record), or a model the record cannot describe: nothing to compare
    differences = record_differences(made_with, current)
    if not differences:
        return None
    return (
        f"{path}: made with {clip(describe_record(made_with), 200)}, but the job's --hf-checkpoint is "
        f"{clip(describe_record(current), 200)} ({'; '.join(differences)}); replay it on the checkpoint it was "
        "made with, or make a new rollout with this one (`miles rollout-only`)"
    )
