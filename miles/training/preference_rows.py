"""Preference rows, the `train sft` data of offline DPO (`--loss-type dpo`; torch-free, shared by the preflight and
the reader, so both stop at the same line with the same words).

One JSON object per line; image paths are relative to the JSONL file's folder:

    {"input": "a handwritten digit 7", "chosen": "images/a.png", "rejected": "images/b.png", "metadata": {...}}

`--input-key` names the caption (a non-empty string), `--chosen-key` and `--rejected-key` (default `chosen`,
`rejected`) the two image files, which must differ, `--metadata-key` an optional dict and `--media-key` optional
condition media (an edit's source image: `"media": [{"role": "condition", "image": "src.png"}]`, read by
`miles.data.media`). Every problem is a one-line ConfigError starting with `file:line` and naming the key and its
flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from miles.core.errors import ConfigError
from miles.data.media import MediaRef, parse_media
from miles.data.prompt_file import iter_jsonl_objects, kind, show_keys, text_field


class PreferenceRow(NamedTuple):
    """One preference row: the image paths as written (relative to the JSONL file's folder)."""

    caption: str
    chosen: str
    rejected: str
    metadata: dict[str, Any]
    media: tuple[MediaRef, ...] = ()


def preference_keys(args: Any) -> tuple[tuple[str, str], tuple[str, str], tuple[str, str]]:
    """((key, flag) of the caption, the chosen image and the rejected image)."""
    return (
        (args.input_key, "--input-key"),
        (args.chosen_key, "--chosen-key"),
        (args.rejected_key, "--rejected-key"),
    )


def check_preference_row(where: str, row: dict[str, Any], args: Any, root: Path) -> PreferenceRow:
    """The fields of one row (media paths joined to `root`, the JSONL file's folder); ConfigError naming `where`
    and the key."""
    (caption_key, _), *images = preference_keys(args)
    for key, flag in preference_keys(args):
        if key not in row:
            raise ConfigError(f"{where}: missing key {key!r} ({flag}) of a preference row; keys: {show_keys(row)}")
    caption = text_field(where, row, caption_key)
    paths = []
    for key, flag in images:
        value = row[key]
        if not isinstance(value, str) or not value.strip():
            shown = kind(value) if not isinstance(value, str) else "an empty string"
            raise ConfigError(f"{where}: {key!r} ({flag}) must be an image file path, got {shown}")
        paths.append(value)
    if paths[0] == paths[1]:
        raise ConfigError(
            f"{where}: {images[0][0]!r} and {images[1][0]!r} name the same image {paths[0]!r}; a preference pair "
            "needs two images"
        )
    metadata = row.get(args.metadata_key) or {}
    if not isinstance(metadata, dict):
        raise ConfigError(f"{where}: {args.metadata_key!r} (--metadata-key) must be a dict, got {kind(metadata)}")
    media = parse_media(where, row, args.media_key, root)
    return PreferenceRow(caption, paths[0], paths[1], dict(metadata), media)


def read_preference_rows(path: Path, args: Any) -> list[PreferenceRow]:
    """Every row of a preference file; ConfigError at the first bad one."""
    rows = []
    for where, _, row in iter_jsonl_objects(path, "preference data"):
        rows.append(check_preference_row(where, row, args, path.parent))
    if not rows:
        raise ConfigError(f"{path}: no preference rows")
    return rows
