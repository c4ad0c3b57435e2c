"""Ctrl-C and SIGTERM: the job stops, shuts down the Ray cluster it started and exits 130 (143 for SIGTERM).

The first signal raises `JobInterrupted` in the driver's main thread (a wait on an actor wakes for it); the job's
`finally` blocks stop the actors and Ray on the way out. A second signal while that runs exits at once.
Checkpoints are written into a hidden folder and renamed into place, so an interrupted save never becomes the
latest. Torch-free and Ray-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class JobInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver (a KeyboardInterrupt, so `except Exception` does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, f"signal {signum}"))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise `JobInterrupted`; a second one exits at once (128 + signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = _RECEIVED
    seen.clear()

    def handler(signum: int, frame: Any) -> None:
        seen.append(signum)
        if len(seen) > 1:
            print("miles: interrupted again; exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        raise JobInterrupted(signum)

    global _ACTIVE
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    _ACTIVE = handler
    try:
        yield
    finally:
        _ACTIVE = None
        for sig, old in previous.items():
            signal.signal(sig, old)


_ACTIVE: Any = None
_RECEIVED: list[int] = []  # the signals the active handler took, in order


def received() -> int | None:
    """The first signal the driver took inside `interrupts()`, if any: Ray's waits turn the `JobInterrupted` the
    handler raised into a plain KeyboardInterrupt, so the signal is read from here."""
    return _RECEIVED[0] if _RECEIVED else None


def as_interrupt(exc: KeyboardInterrupt) -> JobInterrupted:
    """`exc` as the `JobInterrupted` of the signal that caused it (SIGINT when none was recorded: a Ctrl-C that
    reached Python before the handler)."""
    if isinstance(exc, JobInterrupted):
        return exc
    return JobInterrupted(received() or signal.SIGINT)


def reinstall() -> None:
    """Take SIGINT/SIGTERM back after `ray.init` (Ray's core worker installs its own SIGTERM handler)."""
    if _ACTIVE is not None and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ACTIVE)


def last_checkpoint_line(args: Any) -> str:
    """Where a rerun resumes from: the newest complete checkpoint under --save, if any."""
    save = args.save
    if not save:
        return "no checkpoint (no --save)"
    from miles.training.checkpoint_index import read_latest_step

    try:
        step = read_latest_step(save)
    except Exception:
        step = None
    if step is None:
        return f"no complete checkpoint under --save {save}"
    return f"last complete checkpoint: {Path(save)} step {step} (resume with --load {save})"
