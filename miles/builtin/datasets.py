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

    digits-preference:train  preference rows of the train split for offline DPO ({"input": ..., "chosen": rel_png,
                             "rejected": rel_png, "metadata": {"label": k, "rejected_label": j}}: the digit's own
                             image against one of another digit); also a prompt JSONL
    digits-preference:test   the same for the test split

    digits-i2v:train     digits-video's prompt rows with the video's first frame as the condition image
                         ({"input": ..., "media": [{"role": "condition", "image": rel_png}], "metadata": {"label": 7,
                         "direction": "left"}}; image-to-video)
    digits-i2v:test      the same for the test split (eval)
    digits-i2v:sft       the same rows with their target video ({"video": rel_webp, ...}; 9 frames, 64x64)
    digits-i2v:sft-test  the same for the test split

The names and file layout are `miles.builtin.names`'s (torch-free); this module writes them.
"""

from __future__ import annotations

import os
from pathlib import Path

from miles.builtin.names import BUILTIN_DATASETS, DATASET_WRITERS, builtin_dataset_names, builtin_path, parse_dataset


def resolve_dataset(spec: str | os.PathLike) -> Path:
    """The file of a built-in data set (generated on first use); any other spec passes through as a path.

    A spec that looks built-in (`digits:...`) but names an unknown part is a ConfigError.
    """
    spec = str(spec)
    parsed = parse_dataset(spec)
    if parsed is None:
        name, sep, _ = spec.partition(":")
        if sep and name in BUILTIN_DATASETS:
            from miles.core.errors import ConfigError

            raise ConfigError(
                f"unknown built-in data set {spec!r}; built-in data sets: {', '.join(builtin_dataset_names())}"
            )
        return Path(spec).expanduser()
    name = parsed[0]
    import importlib

    from miles.utils.paths import atomic_directory, data_dir, file_lock

    module_name, writer = DATASET_WRITERS[name]
    module = importlib.import_module(module_name)
    root = data_dir() / name
    if not _current(root / module.MANIFEST, module.FORMAT_VERSION):
        with file_lock(data_dir() / f".{name}.lock"):
            if not _current(root / module.MANIFEST, module.FORMAT_VERSION):
                if root.exists():
                    import shutil

                    # an incomplete copy (the manifest is written last) or one of an older format
                    shutil.rmtree(root)
                with atomic_directory(root) as tmp:
                    getattr(module, writer)(tmp)
    path = builtin_path(spec)
    assert path is not None
    return path


def _current(manifest: Path, version: int) -> bool:
    """The data set is complete (its manifest exists) and of this miles' format version."""
    import json

    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format_version") == version
    except (OSError, ValueError):
        return False
