"""The formats prompt data comes in (torch-free): one table of row readers keyed by the format's name, picked by
the file's extension (a folder `Dataset.save_to_disk` wrote is `hf`). Every reader yields `(where, number, row)`
with `row` a dict holding the job's keys, so the records built from them (`miles.data.prompts`) and every check of
them do not depend on the format.

    jsonl    .jsonl .json .ndjson (and a file without an extension): one JSON object a line; `file:line`
    txt      .txt: one prompt a line (stripped; blank lines skipped), no metadata or media; `file:line`
    parquet  .parquet: the columns `--input-key`, `--metadata-key`, `--media-key`; `file:row N` (from 0)
    hf       a `datasets` folder made by `save_to_disk`, read from its Arrow files; `folder:row N` (from 0)

Any other extension is refused in one line naming the formats.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.data.columnar import is_hf_folder, iter_hf_rows, iter_parquet_rows
from miles.data.prompt_file import PromptKeys, iter_jsonl_objects, iter_text_lines, url_problem

Row = tuple[str, int, dict[str, Any]]  # (file:line or file:row N, the line or row number, the row)


def _jsonl_rows(path: Path, keys: PromptKeys) -> Iterator[Row]:
    return iter_jsonl_objects(path)


def _txt_rows(path: Path, keys: PromptKeys) -> Iterator[Row]:
    for where, lineno, text in iter_text_lines(path):
        prompt = text.strip()
        if prompt:
            yield where, lineno, {keys.input: prompt}


@dataclass(frozen=True)
class PromptFormat:
    """A format of prompt data: the extensions it is known by and its row reader."""

    suffixes: tuple[str, ...]
    rows: Callable[[Path, PromptKeys], Iterator[Row]]
    folder: bool = False  # read from a folder, not a file


FORMATS: dict[str, PromptFormat] = {
    "jsonl": PromptFormat((".jsonl", ".json", ".ndjson", ""), _jsonl_rows),
    "txt": PromptFormat((".txt",), _txt_rows),
    "parquet": PromptFormat((".parquet",), iter_parquet_rows),
    "hf": PromptFormat((), iter_hf_rows, folder=True),
}


def format_of(path: Path) -> str:
    """The name of `path`'s format (a key of `FORMATS`); ConfigError for an extension none reads, or a folder
    that is no `save_to_disk` folder."""
    if path.is_dir():
        if is_hf_folder(path):
            return next(name for name, fmt in FORMATS.items() if fmt.folder)
        raise ConfigError(
            f"{path}: is a directory, not a prompt data file (name the file inside it) nor a folder "
            "Dataset.save_to_disk wrote (it has no state.json)"
        )
    suffix = path.suffix.lower()
    for name, fmt in FORMATS.items():
        if suffix in fmt.suffixes:
            return name
    known = ", ".join(s for fmt in FORMATS.values() for s in fmt.suffixes if s)
    raise ConfigError(
        f"{path}: unknown prompt data format {suffix!r} (by its extension); miles reads {known} files and a folder "
        "Dataset.save_to_disk wrote"
    )


def iter_rows(path: str | os.PathLike, keys: PromptKeys) -> Iterator[Row]:
    """Every row of the prompt data at `path`, streamed, through its format's reader."""
    url = url_problem(path)
    if url:
        raise ConfigError(url)
    path = Path(path)
    return FORMATS[format_of(path)].rows(path, keys)


def media_root(path: str | os.PathLike) -> Path:
    """The folder a row's relative media paths start from: the data file's folder (a data set folder: itself)."""
    path = Path(os.path.abspath(path))
    return path if path.is_dir() else path.parent
