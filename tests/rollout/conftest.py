"""Fixtures of the router tests (`test_router.py`, `test_router_health.py`): backends and routers, stopped after
each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from router_helpers import Backend, LoopThread

from miles.rollout.engines.sglang.router import MilesRouter, RouterConfig


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def make_backends(loop_thread: LoopThread) -> Iterator[Callable[[int], list[Backend]]]:
    created: list[Backend] = []

    def make(n: int) -> list[Backend]:
        backends = []
        for _ in range(n):
            backend = Backend(chr(ord("a") + len(created)), loop_thread)
            loop_thread.run(backend._start())
            created.append(backend)
            backends.append(backend)
        return backends

    yield make
    for backend in created:
        backend.release()
        backend.release_health()
        backend.shutdown()


@pytest.fixture
def make_router() -> Iterator[Callable[..., MilesRouter]]:
    routers: list[MilesRouter] = []

    def make(
        backends: list[Backend] = (), on_removed: Callable[[str, str], None] | None = None, **config
    ) -> MilesRouter:
        router = MilesRouter(RouterConfig(**config), on_engine_removed=on_removed)
        for backend in backends:
            router.add_worker(backend.url)
        router.start()
        routers.append(router)
        return router

    yield make
    for router in routers:
        router.stop()
