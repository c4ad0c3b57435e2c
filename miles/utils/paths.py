"""Where miles keeps its files: `$MILES_HOME` (default `~/.cache/miles`).

Torch-free. Layout:
    $MILES_HOME/models/<name>   built checkpoints (e.g. tiny-sd3)
    $MILES_HOME/data/<name>     generated data sets (e.g. digits)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MILES_HOME_ENV = "MILES_HOME"
DEFAULT_MILES_HOME = "~/.cache/miles"


def miles_home() -> Path:
    """The root of miles' cache: `$MILES_HOME`, else `~/.cache/miles` (not created here)."""
    value = os.environ.get(MILES_HOME_ENV) or DEFAULT_MILES_HOME
    return Path(value).expanduser()


def models_dir() -> Path:
    return miles_home() / "models"


def data_dir() -> Path:
    return miles_home() / "data"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created if needed), held for the `with` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_directory(final: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temp dir next to `final`; on success rename it to `final`, on error delete it.

    `final` must not exist (or be an empty directory) when the block ends, unless `replace`: then an existing
    `final` is swapped out only once the new one is whole (and deleted after), so a write killed at any point
    leaves either the old folder or the new one, never neither. An interrupted build never leaves a half-written
    `final` behind, only a `.<name>.tmp-*` sibling that is removed.
    """
    from miles.utils.disk import writing

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        with writing(final):  # out of space while the folder is written: one DiskFull naming it
            yield tmp
        if final.exists() and final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        if replace and final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / final.name)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
