"""A full disk, said as one line: `DiskFull` names the path and "no space left on device".

A write that runs out of space fails in many shapes: an OSError with ENOSPC (or EDQUOT, a quota), or, from
torch's zip writer, a RuntimeError that has lost the errno ("unexpected pos 496512 vs 496404"). `writing(path)`
turns any of them into `DiskFull(path)`; an error that is not about space (checked through the exception chain,
then by the free space left on the path's filesystem) passes through unchanged. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
LOW_SPACE = 1 << 20  # bytes: less than this free after a failed write means the write ran out of space


class DiskFull(OSError):
    """No space left to write `path` (an OSError with errno ENOSPC, so code that handles those handles it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(errno.ENOSPC, "No space left on device", str(path))
        self.path = str(path)

    def __str__(self) -> str:
        free = free_bytes(self.path)
        left = f" ({_size(free)} free there)" if free is not None else ""
        return f"no space left on device: cannot write {self.path}{left}"

    def __reduce__(self) -> tuple[type, tuple[str]]:  # crosses Ray as itself
        return DiskFull, (self.path,)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem of `path` (its nearest existing folder); None when it cannot be read."""
    here = Path(path)
    for candidate in (here, *here.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def is_disk_full(exc: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that ran out of space; with `path`, an
    OSError or RuntimeError without an errno counts when the path's filesystem is (nearly) full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in SPACE_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    if path is not None and isinstance(exc, (OSError, RuntimeError)):
        free = free_bytes(path)
        return free is not None and free < LOW_SPACE
    return False


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, a write that runs out of space raises `DiskFull(path)`; anything else as it was."""
    try:
        yield
    except DiskFull:
        raise
    except (OSError, RuntimeError) as exc:
        if is_disk_full(exc, path):
            raise DiskFull(path) from exc
        raise


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
