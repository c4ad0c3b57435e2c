"""Built-in data sets, named `NAME:PART`, generated under `$MILES_HOME/data/NAME` on first use.

    digits:train     prompt JSONL of the train split  ({"input": ..., "metadata": {"label": k}})
    digits:test      prompt JSONL of the test split (eval)
    digits:labels    the ten prompts, one per digit (RL: every rollout of 10k prompts is balanced)
    digits:sft       SFT image+caption JSONL of the train split ({"image": rel_png, "input": ...})
    digits:sft-test  the same for the test split

`is_builtin_dataset` is cheap and imports nothing heavy (the config validator calls it).
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_DATASETS: dict[str, tuple[str, ...]] = {"digits": ("train", "test", "labels", "sft", "sft-test")}
_MANIFEST = {"digits": "digits.json"}


def _parse(spec: str) -> tuple[str, str] | None:
    name, sep, part = str(spec).partition(":")
    if not sep or name not in BUILTIN_DATASETS or part not in BUILTIN_DATASETS[name]:
        return None
    return name, part


def is_builtin_dataset(spec: str | os.PathLike) -> bool:
    """True for a built-in data set name such as "digits:train" (no file access, no imports)."""
    return _parse(str(spec)) is not None


def builtin_dataset_names() -> list[str]:
    return [f"{name}:{part}" for name, parts in BUILTIN_DATASETS.items() for part in parts]


def resolve_dataset(spec: str | os.PathLike) -> Path:
    """The file of a built-in data set (generated on first use); any other spec passes through as a path.

    A spec that looks built-in (`digits:...`) but names an unknown part is a ConfigError.
    """
    spec = str(spec)
    parsed = _parse(spec)
    if parsed is None:
        name, sep, _ = spec.partition(":")
        if sep and name in BUILTIN_DATASETS:
            from miles.config.errors import ConfigError

            raise ConfigError(
                f"unknown built-in data set {spec!r}; built-in data sets: {', '.join(builtin_dataset_names())}"
            )
        return Path(spec).expanduser()
    name, part = parsed
    from miles.data import digits
    from miles.utils.paths import atomic_directory, data_dir, file_lock

    root = data_dir() / name
    if not _current(root / _MANIFEST[name], digits.FORMAT_VERSION):
        with file_lock(data_dir() / f".{name}.lock"):
            if not _current(root / _MANIFEST[name], digits.FORMAT_VERSION):
                if root.exists():
                    import shutil

                    # an incomplete copy (the manifest is written last) or one of an older format
                    shutil.rmtree(root)
                with atomic_directory(root) as tmp:
                    digits.write_digits_data(tmp)
    return root / digits.FILES[part]


def _current(manifest: Path, version: int) -> bool:
    """The data set is complete (its manifest exists) and of this miles' format version."""
    import json

    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format_version") == version
    except (OSError, ValueError):
        return False
