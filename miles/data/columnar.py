"""Columnar prompt data (torch-free; `pyarrow` is imported only when such a file is read): a Parquet file and a
local Hugging Face `datasets` folder (`Dataset.save_to_disk`: `state.json`, `dataset_info.json` and `*.arrow`
files in Arrow's stream format), read batch by batch, so a large set costs one batch of memory.

Only the columns the job reads are read (`--input-key`, `--metadata-key`, `--media-key`); the input column must
exist, the others may not. Rows are counted from 0, as `dataset[N]` and `table.slice(N)` count them; a problem
names `file:row N` (`folder:row N`). A struct column's fields that a row lacks come back as null; a metadata
field that is null is dropped, so a row reads as the JSON line it was made from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.data.prompt_file import PromptKeys
from miles.utils.text import clip, first_line

# the files a `save_to_disk` folder holds, and the one a `DatasetDict` folder holds instead
HF_STATE = "state.json"
HF_INFO = "dataset_info.json"
HF_DICT = "dataset_dict.json"
_BATCH_ROWS = 1024


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(f"{path}: reading it needs pyarrow (pip install pyarrow)") from None
    return pyarrow


def is_hf_folder(path: Path) -> bool:
    """A folder `Dataset.save_to_disk` wrote (or a `DatasetDict`'s, refused with its splits named)."""
    return path.is_dir() and any((path / name).is_file() for name in (HF_STATE, HF_INFO, HF_DICT))


def _columns(where: str, names: list[str], keys: PromptKeys) -> list[str]:
    """The columns to read: the input column (which must exist) and the metadata and media columns present."""
    if keys.input not in names:
        shown = ", ".join(clip(repr(n), 40) for n in names[:8]) + (f", ... ({len(names)} columns)" * (len(names) > 8))
        raise ConfigError(f"{where}: no column {keys.input!r} (--input-key); columns: {shown or 'none'}")
    return [keys.input] + [k for k in (keys.metadata, keys.media) if k is not None and k in names and k != keys.input]


def _rows(name: str, batches: Iterator[Any], keys: PromptKeys, start: int = 0) -> Iterator[tuple[str, int, dict]]:
    number = start
    for batch in batches:
        for row in _batch_rows(name, batch, number):
            metadata = row.get(keys.metadata) if keys.metadata is not None else None
            if isinstance(metadata, dict):
                row[keys.metadata] = {k: v for k, v in metadata.items() if v is not None}
            yield f"{name}:row {number}", number, row
            number += 1


def _batch_rows(name: str, batch: Any, first: int) -> list[dict[str, Any]]:
    """A batch's rows as dicts; a string cell that is not UTF-8 (Arrow does not check what other writers wrote)
    is a ConfigError naming its row."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        for i in range(batch.num_rows):
            try:
                batch.slice(i, 1).to_pylist()
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{name}:row {first + i}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
                ) from None
        raise


def iter_parquet_rows(path: Path, keys: PromptKeys) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """`(file:row N, N, row)` of a Parquet file, batch by batch."""
    pa = _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path}: not a Parquet file PyArrow reads ({first_line(exc, 120)})") from None
    with handle:
        columns = _columns(str(path), handle.schema_arrow.names, keys)
        try:
            yield from _rows(str(path), handle.iter_batches(batch_size=_BATCH_ROWS, columns=columns), keys)
        except pa.ArrowException as exc:
            raise ConfigError(f"{path}: cannot read the Parquet file ({first_line(exc, 120)})") from None


def _hf_files(folder: Path) -> list[Path]:
    """The `*.arrow` files of a `save_to_disk` folder, in `state.json`'s order."""
    if (folder / HF_DICT).is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / HF_STATE).is_file())
        hint = f"; name one split's folder, e.g. {folder / splits[0]}" if splits else ""
        raise ConfigError(
            f"{folder}: is a DatasetDict folder (splits: {', '.join(splits) or 'none'}), not one data set{hint}"
        )
    state_file = folder / HF_STATE
    if not state_file.is_file():
        raise ConfigError(f"{folder}: no {HF_STATE}; is this a folder Dataset.save_to_disk wrote?")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        detail = f"{type(exc).__name__}: {first_line(exc, 80)}"
        raise ConfigError(f"{state_file}: not a datasets state file ({detail})") from None
    for file in files:
        if not file.is_file():
            raise ConfigError(f"{folder}: {HF_STATE} names {clip(file.name, 80)}, which is not in the folder")
    if not files:
        raise ConfigError(f"{folder}: {HF_STATE} names no data files")
    return files


def iter_hf_rows(folder: Path, keys: PromptKeys) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """`(folder:row N, N, row)` of a `save_to_disk` folder: its Arrow files one after the other, batch by batch
    (memory-mapped)."""
    pa = _pyarrow(folder)
    number = 0
    for file in _hf_files(folder):
        try:
            source = pa.memory_map(str(file))
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"{file}: not an Arrow stream file ({first_line(exc, 120)})") from None
        with source, reader:
            columns = _columns(str(folder), reader.schema.names, keys)
            batches = (batch.select(columns) for batch in reader)
            count = 0
            try:
                for item in _rows(str(folder), batches, keys, start=number):
                    count += 1
                    yield item
            except pa.ArrowException as exc:
                raise ConfigError(f"{file}: cannot read the Arrow file ({first_line(exc, 120)})") from None
            number += count
