"""Data files, read line by line (torch-free): the low floor of the prompt reader the runtime and the preflight
share (`miles.data.prompts` builds the records; `miles.data.formats` picks the reader by the file's format).

A JSONL file holds one object per line (blank lines are skipped):
    {"input": "a photo of a cat", "metadata": {"rm_type": "ocr"}}
`--input-key` names the prompt (a required, non-empty string); `--metadata-key` names an optional dict
(`PromptKeys` holds the keys a job reads, `--media-key` too).

The file is streamed, so a million lines cost seconds, not memory; a line longer than `MAX_LINE_BYTES` is
refused without being read whole. Every problem is a one-line `ConfigError` that starts with `file:line` (or the
file, for the file as a whole) and quotes no user data beyond `CLIP` characters. Only regular local files are
read: a FIFO or a device (`/dev/zero`) is refused before it is opened, a URL is named as the user gave it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.core.errors import ConfigError
from miles.utils.text import clip

MAX_LINE_BYTES = 1 << 20  # 1 MiB: a prompt line is one JSON object, never a whole data set
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class PromptKeys:
    """The keys (columns) a prompt row is read at: `--input-key`, `--metadata-key`, `--media-key`."""

    input: str = "input"
    metadata: str | None = "metadata"
    media: str | None = "media"

    @classmethod
    def of(cls, args: Any, evaluation: bool = False) -> PromptKeys:
        """The keys of the job's prompt data, or (`evaluation`) of its eval sets: `--eval-input-key` and
        `--eval-media-key` when given, else `--input-key` and `--media-key`."""
        input_key = (getattr(args, "eval_input_key", None) if evaluation else None) or args.input_key or "input"
        media_key = (getattr(args, "eval_media_key", None) if evaluation else None) or getattr(args, "media_key", None)
        return cls(input_key, args.metadata_key or "metadata", media_key or "media")


def kind(value: Any) -> str:
    """'an object', 'a list', 'a string', ...: what a JSON value is, for messages."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def show_keys(row: dict[str, Any], limit: int = 8) -> str:
    """The keys of a row for a message: at most `limit`, each clipped."""
    keys = sorted(row)
    shown = ", ".join(clip(repr(k), 40) for k in keys[:limit])
    return (shown + f", ... ({len(keys)} keys)") if len(keys) > limit else (shown or "none")


def url_problem(spec: str | os.PathLike, what: str = "prompt data") -> str | None:
    """The line for a `spec` that is a URL (`https://...`, `hf://...`), quoted as given; None for a path."""
    text = os.fspath(spec)
    if isinstance(text, str) and _URL.match(text):
        return f"{clip(text, 160)}: is a URL, and miles does not read URLs; download it and give a local {what} file"
    return None


def open_data_file(path: Path, what: str):
    """`path` opened for reading bytes; ConfigError (one line) when it is missing, a folder or not a regular file."""
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a {what} file (name the .jsonl file inside it)")
    if not path.is_file():
        if path.exists():  # a FIFO, a device, a socket: reading it may never end
            raise ConfigError(f"{path}: is not a regular file (a device, FIFO or socket); give a {what} file")
        raise ConfigError(f"{path}: {what} file not found")
    try:
        return path.open("rb")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} file ({exc.strerror or exc})") from None


def iter_text_lines(path: str | os.PathLike, what: str = "prompt data") -> Iterator[tuple[str, int, str]]:
    """`(file:line, line, text)` for every line of a UTF-8 text file, blank ones included, streamed; a line
    longer than `MAX_LINE_BYTES` or not UTF-8 is a one-line ConfigError naming `file:line`."""
    url = url_problem(path, what)
    if url:
        raise ConfigError(url)
    path = Path(path)
    handle = open_data_file(path, what)
    name = str(path)
    with handle:
        lineno = 0
        while True:
            try:
                raw_bytes = handle.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise ConfigError(f"{path}: cannot read the {what} file ({exc.strerror or exc})") from None
            if not raw_bytes:
                return
            lineno += 1
            where = f"{name}:{lineno}"
            if len(raw_bytes) > MAX_LINE_BYTES and not raw_bytes.endswith(b"\n"):
                raise ConfigError(
                    f"{where}: line longer than {MAX_LINE_BYTES // 2**20} MiB (MAX_LINE_BYTES, "
                    f"miles.data.prompt_file); a {what} line is one row: is this the right file?"
                )
            try:
                yield where, lineno, raw_bytes.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start + 1})") from None


def iter_jsonl_objects(
    path: str | os.PathLike, what: str = "prompt data"
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """`(file:line, line, object)` for every non-blank line of a JSONL file, streamed; any problem is a
    one-line ConfigError naming the file (and the line)."""
    for where, lineno, raw in iter_text_lines(path, what):
        if not raw.strip():
            continue
        row = _parse_line(where, raw)
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {kind(row)}")
        # valid UTF-8 holds no surrogate: only a JSON escape (`\\udc80`) makes one, so a line without `\\u` is fine
        unencodable = unencodable_text(row) if "\\u" in raw else None
        if unencodable:
            raise ConfigError(f"{where}: {unencodable}")
        yield where, lineno, row


def unencodable_text(value: Any, path: str = "") -> str | None:
    """What in `value` (strings in dicts and lists, at any depth) cannot be written as UTF-8: JSON's `\\udc80`
    escapes make lone surrogates, which every later write (logs, metrics, a tokenizer) would fail on."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                at = f" of key {where!r}" if where else ""
                code = f"\\u{ord(item[exc.start]):04x}"
                return (
                    f"text that cannot be written as UTF-8 (a lone surrogate, {code}, at character "
                    f"{exc.start + 1}{at})"
                )
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
            stack.extend((k, where) for k in item if isinstance(k, str))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


def _parse_line(where: str, raw: str) -> Any:
    """One line's JSON value; ConfigError naming `where` for anything `json.loads` refuses."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: malformed JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        if "integer string conversion" in str(exc):
            limit = sys.get_int_max_str_digits()
            raise ConfigError(
                f"{where}: a number of more than {limit:,} digits (Python's limit for reading an integer)"
            ) from None
        raise ConfigError(f"{where}: malformed JSON ({clip(str(exc).splitlines()[0], 120)})") from None


def prompt_fields(
    where: str, row: dict[str, Any], input_key: str = "input", metadata_key: str | None = "metadata"
) -> tuple[str, dict[str, Any]]:
    """`(prompt, metadata)` of one line; ConfigError naming `where` when the line is not a prompt line."""
    if input_key not in row:
        raise ConfigError(f"{where}: missing key {input_key!r} (--input-key); keys: {show_keys(row)}")
    prompt = text_field(where, row, input_key)
    metadata: Any = {}
    if metadata_key is not None and row.get(metadata_key) is not None:
        metadata = row[metadata_key]
        if not isinstance(metadata, dict):
            raise ConfigError(f"{where}: {metadata_key!r} (--metadata-key) must be a dict, got {kind(metadata)}")
    return prompt, metadata


def text_field(where: str, row: dict[str, Any], key: str) -> str:
    """`row[key]`, a non-empty string (a prompt, a caption); ConfigError naming `where` otherwise."""
    value = row[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {kind(value)}")
    if not value.strip():
        raise ConfigError(f"{where}: {key!r} is empty")
    return value
