"""`--hook-timeout`: a user hook (a reward function, a filter, a loss, a log function) that runs past it ends the
job with one line naming the hook.

A Python call cannot be stopped safely from outside (it may sit in C code), so inside a Ray actor an expired
deadline writes every thread's stack to the actor's log, records the hook as the actor's last words and ends
the process (`on_expire`, set by `miles.utils.actors`); the driver, waiting on the actor, sees it die and
prints that line. In the main thread of a plain process (the driver) it raises `HookTimeout` from SIGALRM,
which also wakes a sleeping call. Elsewhere (another thread of a plain process) it cannot act and only runs.

Torch-free and Ray-free.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

_TIMEOUT: float | None = None
on_expire: Callable[[str], None] | None = None  # the actor's handler: log, last words, end the process


class HookTimeout(RuntimeError):
    """A user hook ran past --hook-timeout."""


def set_hook_timeout(seconds: float | None) -> None:
    global _TIMEOUT
    _TIMEOUT = float(seconds) if seconds else None


def hook_timeout() -> float | None:
    return _TIMEOUT


def message(what: str, seconds: float) -> str:
    return f"{what} did not return within {seconds:g} s (--hook-timeout); its stack is in the log"


@contextlib.contextmanager
def deadline(what: str, seconds: float | None = None) -> Iterator[None]:
    """Run the body under a deadline of `seconds` (default: --hook-timeout; None or 0: no deadline)."""
    seconds = _TIMEOUT if seconds is None else seconds
    if not seconds:
        yield
        return
    if on_expire is not None:
        timer = threading.Timer(seconds, on_expire, (message(what, seconds),))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        return
    with alarm(seconds, lambda: HookTimeout(message(what, seconds).replace("; its stack is in the log", ""))):
        yield


@contextlib.contextmanager
def alarm(seconds: float, error: Callable[[], BaseException]) -> Iterator[None]:
    """Raise `error()` in the body after `seconds` (SIGALRM, which also wakes a sleeping call): the main thread
    only; elsewhere the body runs without a limit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise error()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`fn` under a deadline at every call (an async `fn`, or one returning an awaitable, until it is done);
    `fn` itself when this process has no --hook-timeout (hooks are loaded after the actor or driver set it)."""
    if not _TIMEOUT:
        return fn
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_call(*args: Any, **kwargs: Any) -> Any:
            with deadline(what):
                return await fn(*args, **kwargs)

        return async_call

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with deadline(what):
            result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            return _awaited(result, what)
        return result

    return call


async def _awaited(awaitable: Any, what: str) -> Any:
    with deadline(what):
        return await awaitable
