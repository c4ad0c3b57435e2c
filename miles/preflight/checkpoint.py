"""Checkpoints and outputs: `--load` names a complete checkpoint, and every folder the job writes can be written.

`--load` goes through `miles.training.checkpoint_index.find_loadable_checkpoint` (torch-free; the tracker file,
the folder it names or `--ckpt-step`'s, the manifest's sizes), then the parts the trainer reads must be there
(`model.pt`, `lr_scheduler.pt`, `extra.json`, and `optimizer.pt` unless `--no-load-optim`). A DMD2 critic resumes from
`<load>/critic`. An output folder (`--output-dir`, `--save`, the debug dump templates) must be a folder, or
creatable under its nearest existing parent, and writable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.config.resolve import ResolvedJob

TRAINER_PARTS = ("model.pt", "lr_scheduler.pt", "extra.json")


def load_problem(load_dir: str, ckpt_step: int | None, load_optim: bool) -> str | None:
    """What stops a trainer from resuming from `load_dir` (None: nothing)."""
    from miles.training.checkpoint_index import find_loadable_checkpoint

    try:
        choice = find_loadable_checkpoint(load_dir, ckpt_step)
    except ConfigError as exc:
        return str(exc)
    for warning in choice.warnings:  # a damaged latest checkpoint: said once, before anything starts
        print(f"miles: warning: {warning}", file=sys.stderr, flush=True)
    missing = [name for name in TRAINER_PARTS if not (choice.path / name).is_file()]
    if missing:
        return (
            f"--load {load_dir}: {choice.path.name} has no {', '.join(missing)} (not a checkpoint a miles trainer "
            "saved); give the --save folder of a training run"
        )
    if load_optim and not (choice.path / "optimizer.pt").is_file():
        return (
            f"--load {load_dir}: {choice.path.name} has no optimizer state (saved with --no-save-optim); "
            "add --no-load-optim"
        )
    return None


def check_load(resolved: ResolvedJob) -> list[str]:
    """`--load` of every trainer of the job (the DMD2 critic's is `<load>/critic`)."""
    problems: list[str] = []
    seen: set[str] = set()
    for args in resolved.trainer_args.values():
        load = args.load
        if load is None or str(load) in seen:
            continue
        seen.add(str(load))
        problem = load_problem(str(load), args.ckpt_step, not args.no_load_optim)
        if problem:
            problems.append(problem)
    return problems


def check_save_over_checkpoints(resolved: ResolvedJob) -> list[str]:
    """`--save` into a folder that already holds checkpoints, with no `--load` of it: the new run's first save
    would point `latest_checkpointed_iteration.txt` back to its own early step, orphaning the newer ones."""
    from miles.training.checkpoint_index import available_steps

    args = resolved.args
    save, load = args.save, args.load
    if not save or (load and Path(str(load)).resolve() == Path(str(save)).resolve()):
        return []
    steps = available_steps(save)
    if not steps:
        return []
    return [
        f"--save {save}: already holds checkpoints (steps {', '.join(map(str, steps[-3:]))}) of another run; "
        f"resume it with --load {save}, or give a new --save folder (a fresh start there would overwrite them)"
    ]


def check_finished_runs(resolved: ResolvedJob) -> list[str]:
    """Folders of a finished run are not written over (`miles.io.finished`), through symlinks too: an
    `--output-dir` holding one unless this job continues it (`--load` of its --save), and a `--save` that is
    another run's output directory."""
    from miles.io.finished import describe, finished_run, real

    args = resolved.args
    problems = []
    out = real(args.output_dir)
    shown = str(args.output_dir) if Path(str(args.output_dir)).expanduser() == out else f"{args.output_dir} (-> {out})"
    record = finished_run(out)
    if record is not None:
        continues = bool(args.load) and record.get("save") and str(real(args.load)) == record.get("save")
        if not continues:
            resume = f", or continue it with --load {record['save']}" if record.get("save") else ""
            problems.append(
                f"--output-dir {shown}: holds {describe(record)}; its files stay as they are: give a new "
                f"--output-dir{resume}"
            )
    if args.save is not None and resolved.spec.saves_checkpoints:
        save = real(args.save)
        other = finished_run(save) if save != out else None
        if other is None and save != out and (save / "metrics.jsonl").is_file() and (save / "config.yaml").is_file():
            other = {}
        if other is not None:
            problems.append(
                f"--save {args.save}: is the output directory of {describe(other) if other else 'another run'}; "
                "checkpoints go in a folder of their own (for example <output-dir>/ckpt)"
            )
    return problems


def writable_problem(path: Path) -> str | None:
    """Why the folder `path` cannot be written (None: it is a writable folder, or can be made one)."""
    try:
        return _writable_problem(path)
    except OSError as exc:  # the OS refuses the path itself (a name too long, a loop of links, ...)
        return f"cannot be used ({exc.strerror or exc})"


def _writable_problem(path: Path) -> str | None:
    if path.exists():
        if not path.is_dir():
            return "is a file, not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def _template_dir(template: str) -> Path | None:
    """The folder a `--save-debug-*-data` template writes rollout 0 into (None: a bad template; the runtime's
    `format_rollout_path` names it)."""
    try:
        return Path(template.format(0, rollout_id=0)).expanduser().parent
    except (KeyError, IndexError, ValueError):
        return None


def output_folders(args: Any, job: JobSpec) -> list[tuple[str, str, Path]]:
    """(flag, value, folder) of every folder the job writes. A debug-dump template derived from --dump-details
    is listed under --dump-details (the flag the user gave), with the folder it writes."""
    from miles.config.args import DERIVED

    out = [("--output-dir", str(args.output_dir), Path(str(args.output_dir)).expanduser())]
    if args.save is not None and job.saves_checkpoints:
        out.append(("--save", str(args.save), Path(str(args.save)).expanduser()))
    if args.dump_details is not None:
        out.append(("--dump-details", str(args.dump_details), Path(str(args.dump_details)).expanduser()))
    for dest, flag in (
        ("save_debug_rollout_data", "--save-debug-rollout-data"),
        ("save_debug_train_data", "--save-debug-train-data"),
    ):
        template = getattr(args, dest, None)
        folder = _template_dir(str(template)) if template is not None else None
        if folder is None:
            continue
        if args.dump_details is not None and _source(args, dest) == DERIVED:
            out.append(("--dump-details", str(args.dump_details), folder))
        else:
            out.append((flag, str(template), folder))
    return out


def _source(args: Any, dest: str) -> str | None:
    try:
        return args.source_of(dest)
    except (AttributeError, KeyError):
        return None


def check_outputs(resolved: ResolvedJob) -> list[str]:
    """Every output folder is (or can become) a writable folder; a problem is said once per flag (a folder under
    one already refused under the same flag is not refused again)."""
    problems = []
    refused: list[tuple[str, Path]] = []
    for flag, value, folder in output_folders(resolved.args, resolved.spec):
        if any(flag == f and folder.is_relative_to(seen) for f, seen in refused):
            continue  # the same mistake, seen through a folder derived from it
        problem = writable_problem(folder)
        if problem:
            refused.append((flag, folder))
            shown = value if folder == Path(value).expanduser() else f"{value} (folder {folder})"
            problems.append(f"{flag} {shown}: {problem}; choose another {flag}")
    return problems
