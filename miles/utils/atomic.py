"""Atomic file writes: write to a temp file in the same folder, fsync, then rename over the target.

A crash mid-write leaves the previous file (or none), never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from miles.utils.disk import writing


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """`with atomic_open(path, "wb") as f: ...`: the file appears at `path` only when the block succeeds."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    with writing(path):  # out of space anywhere here: one DiskFull naming `path` (`miles.utils.disk`)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, mode, **kwargs) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
