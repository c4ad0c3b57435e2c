"""Where a checkpoint's component configs are: a local checkpoint directory, or the public configs a family ships
in `miles/models/<family>/real_config/<checkpoint name>/` (`model_index.json` plus each component's
`config.json`, facts only, with a SOURCES.md). Torch-free."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REAL_CONFIG = "real_config"
MODEL_INDEX = "model_index.json"
COUNTS_FILE = "counts.json"


def family_package_dir(family: Any) -> Path:
    """The directory of the package a family's `TrainPipelineConfig` lives in (`miles/models/sd3` for sd3)."""
    module = type(family).__module__
    package = module.rpartition(".")[0] or module
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LookupError(f"model family {family.name!r}: package {package!r} has no directory")
    return Path(next(iter(spec.submodule_search_locations)))


def shipped_config_dir(family: Any, checkpoint: str) -> Path | None:
    """The family's shipped configs for `checkpoint` (an HF repo id or name: its last path component names the
    folder, e.g. `stabilityai/stable-diffusion-3.5-medium` -> `real_config/stable-diffusion-3.5-medium`)."""
    name = str(checkpoint).rstrip("/\\").replace("\\", "/").rpartition("/")[2]
    if not name:
        return None
    path = family_package_dir(family) / REAL_CONFIG / name
    return path if (path / MODEL_INDEX).is_file() else None


def shipped_config_dirs(family: Any) -> list[Path]:
    """Every shipped real-size config folder of a family."""
    root = family_package_dir(family) / REAL_CONFIG
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / MODEL_INDEX).is_file())


def config_dir_for(checkpoint: str | os.PathLike, family: Any) -> Path | None:
    """A local checkpoint directory (its own configs) when `checkpoint` is one (a built-in name such as `tiny-sd3`:
    its built directory, once built), else the family's shipped configs for that name, else None (an HF id whose
    configs miles does not ship)."""
    from miles.builtin.names import builtin_path, is_builtin_model

    name = os.fspath(checkpoint)
    local = builtin_path(name) if is_builtin_model(name) else Path(os.path.expanduser(name))
    if (local / MODEL_INDEX).is_file():
        return local
    return shipped_config_dir(family, name)


def read_model_index(config_dir: Path) -> dict[str, Any]:
    with open(config_dir / MODEL_INDEX) as f:
        return json.load(f)


def listed_components(config_dir: Path) -> Iterator[tuple[str, str, str]]:
    """`(name, library, class name)` of every component `model_index.json` lists (modules or not; None
    entries skipped), in name order."""
    for name, spec in sorted(read_model_index(config_dir).items()):
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2:
            continue
        library, class_name = spec
        if library is None or class_name is None:
            continue
        yield name, str(library), str(class_name)


def config_files(config_dir: Path) -> list[Path]:
    """The files the sizes depend on: `model_index.json` and each listed component's `config.json`."""
    files = [config_dir / MODEL_INDEX]
    for name, _, _ in listed_components(config_dir):
        path = config_dir / name / "config.json"
        if path.is_file():
            files.append(path)
    return files


def config_hash(config_dir: Path) -> str:
    """sha256 over the config files' relative paths and bytes (weights and tokenizers play no part)."""
    digest = hashlib.sha256()
    for path in config_files(config_dir):
        digest.update(path.relative_to(config_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
