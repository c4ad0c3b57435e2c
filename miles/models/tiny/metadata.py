"""tiny-sd3 facts that rollout and training must share, read from the checkpoint (torch-free).

The builder writes `miles_tiny_sd3.json` into the checkpoint dir; `max_sequence_length(ckpt)` is
the T5 prompt length every diffusers call (`pipe(..., max_sequence_length=...)`,
`pipe.encode_prompt(...)`) and every trainer-side encode must use for this checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from miles.builtin.names import TINY_SD3_NAME, builtin_path, is_builtin_model

METADATA_FILE = "miles_tiny_sd3.json"  # tiny-sd3's (and the digits teachers') metadata file
TINY_METADATA_FILE = "miles_tiny.json"  # every other tiny family's builds (tiny-flux, tiny-qwen-image, ...)
METADATA_FILES = (METADATA_FILE, TINY_METADATA_FILE)
FORMAT_VERSION = 1
TINY_MAX_SEQUENCE_LENGTH = 8  # T5 tokens; the digit prompts need 5 (with </s>)
TINY_RESOLUTION = 64
DIFFUSERS_SD3_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's own default
# a tiny build's design, written into its metadata as "design": bumped when a builder's architecture changes,
# so a cached build of an older design is rebuilt on first use instead of loaded (absent: design 1)
TINY_DESIGNS: dict[str, int] = {
    "tiny-wan2_2": 2,  # 2: one token per latent frame (patch 1x16x16, width 512), a 2-channel VAE
    "tiny-ltx2": 2,  # 2: a 16x16-patch VAE (16 channels, 144 video tokens), a 2-layer DiT 128 wide, 8 text tokens
    "tiny-flux-kontext": 2,  # 2: the VAE also fits the edit task's 48-px sources (32 px before)
}


def _checkpoint_path(checkpoint: str | os.PathLike) -> Path:
    if is_builtin_model(checkpoint):  # the tiny builds and the digits SFT start points, by name
        return builtin_path(checkpoint)
    return Path(checkpoint).expanduser()


def metadata_path(checkpoint: str | os.PathLike) -> Path | None:
    """The tiny-model metadata file of a checkpoint dir, or None if it has none."""
    folder = _checkpoint_path(checkpoint)
    for name in METADATA_FILES:
        if (folder / name).is_file():
            return folder / name
    return None


def read_metadata(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The tiny-model metadata of a checkpoint dir (or a built-in name such as "tiny-sd3"), or None."""
    path = metadata_path(checkpoint)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def current_design(name: str) -> int:
    """The design today's builder of the tiny model `name` makes."""
    return TINY_DESIGNS.get(name, 1)


def built_design(folder: Path) -> int:
    """The design recorded in a tiny build's metadata (1 when the build predates the field or has none)."""
    meta = read_metadata(folder)
    return int(meta.get("design", 1)) if meta is not None else 1


def is_tiny_sd3(checkpoint: str | os.PathLike) -> bool:
    return str(checkpoint) == TINY_SD3_NAME or read_metadata(checkpoint) is not None


def max_sequence_length(checkpoint: str | os.PathLike, default: int = DIFFUSERS_SD3_MAX_SEQUENCE_LENGTH) -> int:
    """The T5 max_sequence_length to use with `checkpoint`: the stored one for tiny-sd3, else `default`."""
    meta = read_metadata(checkpoint)
    if meta is not None:
        return int(meta.get("max_sequence_length", default))  # a build without text truncation: the default
    return TINY_MAX_SEQUENCE_LENGTH if str(checkpoint) == TINY_SD3_NAME else default


def default_resolution(checkpoint: str | os.PathLike, default: int | None = None) -> int | None:
    """The image side the checkpoint was built for (64 for tiny-sd3), else `default`."""
    meta = read_metadata(checkpoint)
    if meta is not None:
        return int(meta["resolution"])
    return TINY_RESOLUTION if str(checkpoint) == TINY_SD3_NAME else default
