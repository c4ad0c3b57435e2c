"""Building a job's built-in inputs: once, in the driver, before any engine or trainer process needs them
(`prepare_inputs`), and on a process that finds one missing (`ensure_input`, through `miles.core.inputs`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.names import builtin_path, builtin_paths, is_builtin_model


def ensure_input(name: str, path: Path, progress: bool = False) -> Path:
    """The built-in model or data set `name`, built at `path` when it is not there yet (the path must be the one
    the config derived for it: `$MILES_HOME` is the same for the driver and this process)."""
    if builtin_path(name) != path:
        from miles.core.errors import ConfigError

        raise ConfigError(
            f"built-in {name!r}: the job resolved it to {path}, but this process's $MILES_HOME puts it at "
            f"{builtin_path(name)}; give every process of a job the same MILES_HOME"
        )
    if is_builtin_model(name):
        from miles.builtin.checkpoints import ensure_checkpoint

        return ensure_checkpoint(name, progress=progress)
    from miles.builtin.datasets import resolve_dataset

    return resolve_dataset(name)


def prepare_inputs(args: Any) -> None:
    """Build what the job starts from when it is missing (the embedded models, the built-in data sets), here in
    the driver, with a progress bar. The built-in data sets of an `--eval-config` file (read here, at run time)
    join `args.inputs`."""
    if args.eval_config:
        from miles.rollout.evaluation import eval_datasets

        extra = builtin_paths(dataset.path for dataset in eval_datasets(args))
        if extra:
            args.inputs = {**args.inputs, **extra}
    for name, path in (args.inputs or {}).items():
        ensure_input(name, Path(path), progress=True)
