"""`input_path(args, value)`: the local path of one of a job's model or data inputs.

A built-in name (`tiny-sd3`, `digits:labels`) was resolved once, by the config, into `args.inputs` (where it
lives under `$MILES_HOME`); anything else is a path as given (`~` expanded). Nothing here knows a built-in name.
A process that finds a built-in input missing from its disk (another node's `$MILES_HOME`, or a caller that
skipped the job's preparation) builds it there, under the same lock as the driver's build.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# what builds a missing built-in input; above every floor that reads inputs, so it is named by path
ENSURE_INPUT = "miles.builtin.inputs:ensure_input"


def input_path(args: Any, value: str | os.PathLike | None) -> Path | None:
    """Where `value` (a model or data flag's value, or one of its trainers' overrides) is on this machine."""
    if value is None:
        return None
    mapped = (getattr(args, "inputs", None) or {}).get(os.fspath(value))
    if mapped is None:
        text = os.fspath(value)
        return Path(text).expanduser() if text.startswith("~") else Path(text)
    return ensure_builtin(os.fspath(value), Path(mapped))


def ensure_builtin(name: str, path: Path) -> Path:
    """The built-in input `name` at `path` (its place under `$MILES_HOME`), built first if it is not there."""
    from miles.utils.dotted import import_dotted  # the one loader, on this floor

    return import_dotted(ENSURE_INPUT)(name, path)
