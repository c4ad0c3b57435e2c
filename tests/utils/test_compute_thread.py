"""`run_on_own_thread`: the constructor and the public methods of an actor class on one thread of its own."""

from __future__ import annotations

import threading

import pytest

from miles.utils.compute_thread import ComputeThread, run_on_own_thread


class Worker:
    def __init__(self, fail: bool = False) -> None:
        if fail:
            raise ValueError("constructor failed")
        self.init_thread = threading.get_ident()

    def where(self) -> int:
        return threading.get_ident()

    def nested(self) -> tuple[int, int]:  # a method calling another: no deadlock, same thread
        return self.where(), threading.get_ident()

    def health(self) -> int:
        return threading.get_ident()

    def boom(self) -> None:
        raise KeyError("from the method")


def test_constructor_and_methods_share_one_thread_that_is_not_the_callers() -> None:
    cls = run_on_own_thread(Worker, elsewhere=("health",))
    w = cls()
    assert w.where() == w.init_thread != threading.get_ident()
    assert w.nested() == (w.init_thread, w.init_thread)
    assert w.health() == threading.get_ident()  # "elsewhere": where the caller runs it
    assert cls.__name__ == "Worker" and isinstance(w, Worker)


def test_errors_reach_the_caller_unchanged() -> None:
    cls = run_on_own_thread(Worker)
    with pytest.raises(ValueError, match="constructor failed"):
        cls(fail=True)
    with pytest.raises(KeyError, match="from the method"):
        cls().boom()


def test_calls_from_several_threads_run_one_at_a_time_on_the_same_thread() -> None:
    thread = ComputeThread("t")
    seen: list[int] = []
    callers = [threading.Thread(target=lambda: seen.append(thread.run(threading.get_ident))) for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert len(seen) == 4 and len(set(seen)) == 1
