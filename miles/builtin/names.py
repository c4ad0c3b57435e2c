"""The catalogue of the embedded default: every built-in name and where it lives (torch-free; it imports only
`miles.utils.paths`, so the config's rules and the models' metadata may read it though the package sits above
training).

The tiny builds (name -> the builder's `module:function`, `(out_dir, seed=, progress=) -> BuildReport`), the
digits SFT start points (name -> their optimizer steps) and the built-in data sets (`NAME:PART` -> a file under
`$MILES_HOME/data/NAME`). `builtin_path` says where one lives (built or not); `miles.builtin.checkpoints` and
`miles.builtin.datasets` build them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TINY_SD3_NAME = "tiny-sd3"

# the offline tiny builds: name -> "module:function" with the signature (out_dir, seed=, progress=) -> BuildReport
TINY_BUILDERS: dict[str, str] = {
    TINY_SD3_NAME: "miles.builtin.tiny.sd3:build_tiny_sd3",
    "tiny-flux": "miles.builtin.tiny.flux:build_tiny_flux",
    "tiny-flux-kontext": "miles.builtin.tiny.flux_kontext:build_tiny_flux_kontext",
    "tiny-flux2-klein": "miles.builtin.tiny.flux2:build_tiny_flux2_klein",
    "tiny-z-image": "miles.builtin.tiny.z_image:build_tiny_z_image",
    "tiny-qwen-image": "miles.builtin.tiny.qwen_image:build_tiny_qwen_image",
    "tiny-qwen-image-edit": "miles.builtin.tiny.qwen_image_edit:build_tiny_qwen_image_edit",
    "tiny-wan2_2": "miles.builtin.tiny.wan2_2:build_tiny_wan2_2",
    "tiny-wan2_2-i2v": "miles.builtin.tiny.wan2_2_i2v:build_tiny_wan2_2_i2v",
    "tiny-wan2_2-ti2v": "miles.builtin.tiny.wan2_2_ti2v:build_tiny_wan2_2_ti2v",
    "tiny-ltx2": "miles.builtin.tiny.ltx:build_tiny_ltx2",
    "tiny-cosmos3": "miles.builtin.tiny.cosmos3:build_tiny_cosmos3",
}

SFT_TEACHERS: dict[str, int] = {
    "tiny-sd3-digits-sft": 1000,  # optimizer steps at batch 64
    "tiny-sd3-digits-sft-short": 525,
    "tiny-flux-digits-sft-short": 100,  # digit reward 0.33, where its SFT curve turns steep (0.75 at 125)
    "tiny-flux2-klein-digits-sft-short": 300,  # digit reward 0.25, where its SFT curve turns steep (0.61 at 400)
    "tiny-z-image-digits-sft-short": 150,  # between accuracy 0.16 at 100 and 0.58 at 200, where its curve turns steep
    "tiny-qwen-image-digits-sft-short": 150,  # digit reward 0.35 (0.21 at 100, 0.48 at 200)
    "tiny-wan2_2-digits-sft-short": 100,  # eval reward 0.32 (accuracy 0.34; 0.73 at 200, 0.93 at 300)
    "tiny-cosmos3-digits-sft-short": 50,  # eval reward 0.59 on the ten prompts (0.10 at 25 steps)
    "tiny-ltx2-digits-sft-short": 1000,  # video stream only (the ltx patch group)
    "tiny-flux-kontext-edit-sft-short": 500,  # the digits edit task (digits-edit:sft), cosine over the 500 steps
    "tiny-qwen-image-edit-sft-short": 500,  # the digits edit task, as tiny-flux-kontext's (not measured yet)
    "tiny-wan2_2-i2v-digits-sft-short": 150,  # the digits I2V task: eval digit_i2v 0.34 on 40 test prompts (10 steps)
    "tiny-wan2_2-ti2v-digits-sft-short": 100,  # the digits I2V task on the TI2V layout (not measured yet)
}
BUILTIN_MODELS = (*TINY_BUILDERS, *SFT_TEACHERS)

# the built-in data sets: name -> its parts; a part is this file of the set's folder (the part -> its path there)
DATASET_FILES: dict[str, str] = {
    "train": "train.jsonl",
    "test": "test.jsonl",
    "labels": "labels.jsonl",
    "sft": "sft/train.jsonl",
    "sft-test": "sft/test.jsonl",
}
BUILTIN_DATASETS: dict[str, tuple[str, ...]] = {
    "digits": tuple(DATASET_FILES),
    "digits-video": tuple(DATASET_FILES),
    "digits-preference": ("train", "test"),  # preference rows (offline DPO), which are prompt lines too
    "digits-edit": ("train", "test", "sft", "sft-test"),  # the edit task: rows with a source image (media)
    "digits-i2v": ("train", "test", "sft", "sft-test"),  # image-to-video: digits-video with its first frame (media)
}
# the sets whose rows carry condition images (media), and how many per row; the others carry none
DATASET_CONDITION_IMAGES: dict[str, int] = {"digits-edit": 1, "digits-i2v": 1}
# name -> (module, writer): the module has FORMAT_VERSION and MANIFEST; writer(out_dir) writes the whole set
DATASET_WRITERS: dict[str, tuple[str, str]] = {
    "digits": ("miles.data.digits", "write_digits_data"),
    "digits-video": ("miles.data.digits_video", "write_digits_video_data"),
    "digits-preference": ("miles.data.digit_preferences", "write_digit_preference_data"),
    "digits-edit": ("miles.data.digits_edit", "write_digits_edit_data"),
    "digits-i2v": ("miles.data.digits_i2v", "write_digits_i2v_data"),
}


def is_builtin_model(name: str | os.PathLike | None) -> bool:
    return name is not None and str(name) in BUILTIN_MODELS


def parse_dataset(spec: str | os.PathLike) -> tuple[str, str] | None:
    """(name, part) of a built-in data set name such as "digits:train", else None (no file access)."""
    name, sep, part = str(spec).partition(":")
    if not sep or name not in BUILTIN_DATASETS or part not in BUILTIN_DATASETS[name]:
        return None
    return name, part


def is_builtin_dataset(spec: str | os.PathLike | None) -> bool:
    """True for a built-in data set name such as "digits:train" (no file access, no imports)."""
    return spec is not None and parse_dataset(spec) is not None


def builtin_dataset_names() -> list[str]:
    return [f"{name}:{part}" for name, parts in BUILTIN_DATASETS.items() for part in parts]


def is_builtin(value: str | os.PathLike | None) -> bool:
    """A built-in model or data set name."""
    return is_builtin_model(value) or is_builtin_dataset(value)


def builtin_path(value: str | os.PathLike) -> Path | None:
    """Where the built-in model or data set `value` lives under `$MILES_HOME` (built or not), else None."""
    from miles.utils.paths import data_dir, models_dir

    if is_builtin_model(value):
        return models_dir() / str(value)
    parsed = parse_dataset(value)
    if parsed is None:
        return None
    name, part = parsed
    return data_dir() / name / DATASET_FILES[part]


def builtin_paths(values: Iterable[Any]) -> dict[str, str]:
    """{built-in name: where it lives} for the built-in names among `values` (strings, or mappings and lists of
    them, as `--eval-prompt-data` holds); in first-seen order."""
    found: dict[str, str] = {}
    for value in values:
        if isinstance(value, dict):
            found.update(builtin_paths(value.values()))
        elif isinstance(value, (list, tuple)):
            found.update(builtin_paths(value))
        elif isinstance(value, (str, os.PathLike)) and is_builtin(value):
            found.setdefault(str(value), str(builtin_path(value)))
    return found
