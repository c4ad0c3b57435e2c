"""A finished run's folders are never written over.

A job that ends with exit 0 leaves `<output-dir>/.miles-finished` (its job, when it finished, its --save, each as a
real path). Before a job starts, the preflight (`miles.preflight.checkpoint.check_finished_runs`) resolves the
output and save folders through symlinks and refuses, in one line naming the finished run:
- `--output-dir` holding a finished run, unless this job continues it (`--load` of that run's --save);
- `--save` pointing at another run's output directory (checkpoints go in a folder of their own).
Torch-free and Ray-free.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from miles.utils.atomic import atomic_write_text

MARKER = ".miles-finished"


def real(path: str | os.PathLike) -> Path:
    """`path` with `~` and every symlink resolved (a folder reached two ways is one folder)."""
    return Path(path).expanduser().resolve()


def mark_finished(args: Any, job: str) -> None:
    """Record that the job writing `args.output_dir` finished (exit 0)."""
    record = {
        "job": job,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
        "save": str(real(args.save)) if getattr(args, "save", None) else None,
    }
    atomic_write_text(real(args.output_dir) / MARKER, json.dumps(record) + "\n")


def finished_run(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the finished run whose output directory `folder` is (None: none finished there)."""
    try:
        record = json.loads((real(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else {}


def describe(record: dict[str, Any]) -> str:
    """'a finished `train rl` run (2026-12-06 18:02:11)'."""
    job = str(record.get("job") or "miles")
    when = record.get("finished")
    return f"a finished {job} run" + (f" ({when})" if when else "")
