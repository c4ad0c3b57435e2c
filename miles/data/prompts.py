"""Prompt records (torch-free): the reader the runtime and the preflight share, over every format of
`miles.data.formats`, so a problem the preflight finds is the row the runtime would have stopped at.

A prompt row holds its prompt at `--input-key` (a required, non-empty string), an optional dict at
`--metadata-key` and optional condition media at `--media-key` (`miles.data.media`):

    {"input": "make the digit a 7", "media": [{"role": "condition", "image": "src.png"}], "metadata": {"label": 7}}

An SFT row (`{"image": ..., "input": ...}`) may carry the same media list (an edit: the source media, the
instruction and the target image); `check_sft_row` reads its fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.data.formats import iter_rows, media_root
from miles.data.media import MediaRef, parse_media
from miles.data.prompt_file import PromptKeys, prompt_fields, text_field

DEFAULT_KEYS = PromptKeys()


@dataclass(frozen=True)
class PromptRecord:
    """One prompt row."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    line: int = 0  # the line of a text file, the row (from 0) of a columnar one
    media: tuple[MediaRef, ...] = ()


def prompt_record(where: str, number: int, row: dict[str, Any], keys: PromptKeys, root: Path) -> PromptRecord:
    """The record of one row; ConfigError naming `where` when the row is not a prompt row."""
    prompt, metadata = prompt_fields(where, row, keys.input, keys.metadata)
    return PromptRecord(prompt, metadata, number, parse_media(where, row, keys.media, root))


def iter_prompt_rows(
    path: str | os.PathLike, keys: PromptKeys = DEFAULT_KEYS
) -> Iterator[tuple[str, dict[str, Any], PromptRecord]]:
    """`(where, row, record)` for every prompt row, streamed; ConfigError on the first bad row or an empty file."""
    root = media_root(path)
    count = 0
    for where, number, row in iter_rows(path, keys):
        count += 1
        yield where, row, prompt_record(where, number, row, keys, root)
    if not count:
        raise ConfigError(f"{path}: no prompts (the file is empty)")


def load_prompts(path: str | os.PathLike, keys: PromptKeys = DEFAULT_KEYS) -> list[PromptRecord]:
    """Every record of the prompt data at `path`; every problem is a one-line ConfigError naming its row."""
    return [record for _, _, record in iter_prompt_rows(path, keys)]


def check_sft_row(where: str, row: dict[str, Any], keys: PromptKeys, root: Path) -> tuple[MediaRef, ...]:
    """An SFT row names its image (or video) and its caption at `--input-key`, a non-empty string (as a prompt
    row's prompt is), and may carry media at `--media-key`: its media; ConfigError naming `where`."""
    if ("image" not in row and "video" not in row) or keys.input not in row:
        raise ConfigError(f"{where}: an SFT row needs 'image' (or 'video') and {keys.input!r} (--input-key)")
    text_field(where, row, keys.input)
    return parse_media(where, row, keys.media, root)
