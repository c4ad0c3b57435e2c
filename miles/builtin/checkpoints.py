"""`ensure_checkpoint(name_or_path)`: map built-in model names to their local checkpoint, building
it on first use; pass everything else through (a local path or an HF repo id).

Torch-free at import. The build runs under a file lock (`$MILES_HOME/models/.<name>.lock`), into a
temp sibling that is renamed into place, so concurrent callers wait for one build and an
interrupted build never leaves a half checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from miles.builtin.names import BUILTIN_MODELS, SFT_TEACHERS, TINY_BUILDERS, is_builtin_model
from miles.builtin.teachers import build_digits_teacher, is_current
from miles.core.errors import ConfigError
from miles.models.tiny.metadata import METADATA_FILES, built_design, current_design
from miles.utils.dotted import import_dotted
from miles.utils.paths import file_lock, models_dir


def builtin_checkpoint_dir(name: str) -> Path:
    """Where the built-in model `name` lives: `$MILES_HOME/models/<name>`."""
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}")
    return models_dir() / name


def is_complete(path: Path, name: str | None = None) -> bool:
    """A whole checkpoint; for a built-in `name`, also one made by today's builder (a tiny build of today's
    design, a digits teacher with today's step count from such a base)."""
    whole = any((path / f).is_file() for f in METADATA_FILES) and (path / "model_index.json").is_file()
    return whole and (name is None or not _outdated(path, name))


def _outdated(path: Path, name: str) -> bool:
    if name in SFT_TEACHERS:
        return not is_current(path, name)
    return name in TINY_BUILDERS and built_design(path) != current_design(name)


def ensure_checkpoint(name_or_path: str | os.PathLike, progress: bool = True, seed: int = 0) -> Path:
    """A built-in name (`tiny-sd3`, `tiny-flux`, ...) -> `$MILES_HOME/models/<name>` (built on first use,
    seeded); anything else -> `Path(name_or_path)`."""
    name = str(name_or_path)
    if not is_builtin_model(name):
        return Path(name).expanduser() if name.startswith("~") else Path(name)
    target = builtin_checkpoint_dir(name)
    if is_complete(target, name):
        return target
    with file_lock(target.parent / f".{name}.lock"):
        if is_complete(target, name):  # another process built it while we waited
            return target
        if is_complete(target):
            import shutil

            shutil.rmtree(target)  # our own cache, made by an older builder or step count: rebuild it
        if target.exists():
            raise ConfigError(
                f"{target} exists but is not a complete {name} checkpoint; remove it and retry "
                f"(or run `miles models build {name} --force`)"
            )
        if name in SFT_TEACHERS:
            build_digits_teacher(name, target, progress=progress)
        else:
            tiny_builder(name)(target, seed=seed, progress=progress)
    return target


def tiny_builder(name: str):
    """The build function of the tiny model `name` (imported on use: it loads torch and diffusers)."""
    return import_dotted(TINY_BUILDERS[name])
