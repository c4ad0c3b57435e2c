"""One thread for all of an actor's torch work.

torch's CPU intra-op parallelism is OpenMP, and OpenMP keeps one pool of worker threads per thread that starts
parallel work. A Ray actor with concurrency groups (the engine's "health" group) runs its constructor on the
process's main thread and its default-group methods on another thread, so an engine that loads its model in the
constructor and generates in a method has two pools taking turns on the same cores: generation measured 1.25 to
1.35x slower on 2 cores than with one thread doing both (issue 46; `docs/performance.md`). `run_on_own_thread`
gives such an actor one thread of its own for its constructor and every method that touches torch; the methods
of other concurrency groups (health checks, answered while it generates) stay where Ray runs them.
"""

from __future__ import annotations

import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


class ComputeThread:
    """A single worker thread; `run(fn, ...)` runs `fn` on it and returns its result or raises its error (called
    on that thread itself, e.g. a method calling another, it runs `fn` at once)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._mark)
        self._ident: int | None = None

    def _mark(self) -> None:
        self._ident = threading.get_ident()

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()


def run_on_own_thread(cls: T, elsewhere: tuple[str, ...] = ()) -> T:
    """A subclass of `cls` whose constructor and public methods (all but `elsewhere`) run on one `ComputeThread`
    of the instance. An error raised there is raised to the caller unchanged (a constructor that raises is still
    Ray's creation-task failure)."""
    namespace: dict[str, Any] = {}
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._compute_thread = ComputeThread(cls.__name__)
        self._compute_thread.run(original_init, self, *args, **kwargs)

    namespace["__init__"] = __init__
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in elsewhere:
            continue
        namespace[name] = _on_thread(member)
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    return type(cls.__name__, (cls,), namespace)  # type: ignore[return-value]


def _on_thread(method: Any) -> Any:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._compute_thread.run(method, self, *args, **kwargs)

    return call
