"""Built-in data sets, named `NAME:PART`, generated under `$MILES_HOME/data/NAME` on first use.

    digits:train     prompt JSONL of the train split  ({"input": ..., "metadata": {"label": k}})
    digits:test      prompt JSONL of the test split (eval)
    digits:labels    the ten prompts, one per digit (RL: every rollout of 10k prompts is balanced)
    digits:sft       SFT image+caption JSONL of the train split ({"image": rel_png, "input": ...})
    digits:sft-test  the same for the test split

    digits-video:train     prompt JSONL of moving digits ({"input": "the digit 7 moving left",
                           "metadata": {"label": 7, "direction": "left"}}; directions balanced per digit)
    digits-video:test      the same for the test split (eval)
    digits-video:labels    the 40 prompts, every digit x every direction (RL: rollouts of 40k prompts balance)
    digits-video:sft       SFT video+caption JSONL ({"video": rel_webp, "input": ...}; 9 frames, 64x64)
    digits-video:sft-test  the same for the test split

`is_builtin_dataset` is cheap and imports nothing heavy (the config validator calls it).
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_DATASETS: dict[str, tuple[str, ...]] = {
    "digits": ("train", "test", "labels", "sft", "sft-test"),
    "digits-video": ("train", "test", "labels", "sft", "sft-test"),
}
_MANIFEST = {"digits": "digits.json", "digits-video": "digits-video.json"}
# name -> (module, writer): the module has FORMAT_VERSION and FILES; writer(out_dir) writes the whole set
_WRITERS = {
    "digits": ("miles.data.digits", "write_digits_data"),
    "digits-video": ("miles.data.digits_video", "write_digits_video_data"),
}


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
            from miles.core.errors import ConfigError

            raise ConfigError(
                f"unknown built-in data set {spec!r}; built-in data sets: {', '.join(builtin_dataset_names())}"
            )
        return Path(spec).expanduser()
    name, part = parsed
    import importlib

    from miles.utils.paths import atomic_directory, data_dir, file_lock

    module_name, writer = _WRITERS[name]
    module = importlib.import_module(module_name)
    root = data_dir() / name
    if not _current(root / _MANIFEST[name], module.FORMAT_VERSION):
        with file_lock(data_dir() / f".{name}.lock"):
            if not _current(root / _MANIFEST[name], module.FORMAT_VERSION):
                if root.exists():
                    import shutil

                    # an incomplete copy (the manifest is written last) or one of an older format
                    shutil.rmtree(root)
                with atomic_directory(root) as tmp:
                    getattr(module, writer)(tmp)
    return root / module.FILES[part]


def _current(manifest: Path, version: int) -> bool:
    """The data set is complete (its manifest exists) and of this miles' format version."""
    import json

    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format_version") == version
    except (OSError, ValueError):
        return False
