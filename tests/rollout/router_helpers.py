"""The router tests' parts: real aiohttp backends on free ports in one loop thread, HTTP helpers, and an
`on_engine_removed` recorder (fixtures in `conftest.py`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import requests
from aiohttp import web

from miles.rollout.engines.sglang.router import MilesRouter

GENERATE = "/rollout/generate"


# ---------------------------------------------------------------------------- helpers


class LoopThread:
    """One asyncio loop in a daemon thread that hosts every backend server of a test module."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-backends", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run_sync(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop and wait for it."""

        async def run() -> None:
            fn()

        self.run(run())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Backend:
    """A fake engine: echoes ``<name>|<body>`` with the request's content type; counts what it sees.

    Knobs (set from the test thread): ``status`` of generate answers, ``delay`` seconds, ``hold()``/``release()``
    to park requests until released, ``health_status`` of /health, ``hold_health(n)`` (the n-th /health hit
    and later ones wait until ``release_health()``), and ``shutdown()`` to kill it (connection refused after).
    """

    def __init__(self, name: str, loop_thread: LoopThread) -> None:
        self.name = name
        self.lt = loop_thread
        self.status = 200
        self.delay = 0.0
        self.health_status = 200
        self.hold_health_from: int | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self.served = 0
        self.health_hits = 0
        self.seen: list[tuple[str, str, str | None, bytes]] = []  # (method, path?query, content type, body)
        self.alive = False
        self._gate = asyncio.Event()
        self._gate.set()
        self._health_gate = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.alive = True

    async def _echo(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.read()
            if self.delay:
                await asyncio.sleep(self.delay)
            await self._gate.wait()
            self.served += 1
            content_type = request.headers.get("Content-Type")
            self.seen.append((request.method, request.path_qs, content_type, body))
            headers = {"Content-Type": content_type or "application/x-none", "X-Not-Forwarded": "1"}
            return web.Response(status=self.status, body=self.name.encode() + b"|" + body, headers=headers)
        finally:
            self.in_flight -= 1

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        if self.hold_health_from is not None and self.health_hits >= self.hold_health_from:
            await self._health_gate.wait()
        return web.Response(status=self.health_status, text=self.name)

    def hold(self) -> None:
        self.lt.run_sync(self._gate.clear)

    def release(self) -> None:
        self.lt.run_sync(self._gate.set)

    def hold_health(self, from_hit: int) -> None:
        self.lt.run_sync(self._health_gate.clear)
        self.hold_health_from = from_hit

    def release_health(self) -> None:
        self.hold_health_from = None
        self.lt.run_sync(self._health_gate.set)

    def shutdown(self) -> None:
        if self.alive and self.runner is not None:
            self.alive = False
            self.lt.run(self.runner.cleanup())


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def call(
    method: str, url: str, body: bytes = b"", content_type: str | None = "application/msgpack", timeout: float = 10.0
) -> requests.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    with requests.Session() as session:
        session.trust_env = False  # never through a proxy from the environment
        return session.request(method, url, data=body, headers=headers, timeout=timeout)


def post(router: MilesRouter, body: bytes = b"x", path: str = GENERATE, **kwargs) -> requests.Response:
    return call("POST", router.url + path, body, **kwargs)


class Removals:
    """An on_engine_removed callback that records its calls (optionally blocking until released)."""

    def __init__(self, block: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.unblocked = threading.Event()
        if not block:
            self.unblocked.set()
        self.extra: Callable[[str], object] | None = None
        self.extras: list[object] = []

    def __call__(self, url: str, reason: str) -> None:
        self.calls.append((url, reason))
        self.threads.append(threading.current_thread().name)
        if self.extra is not None:
            self.extras.append(self.extra(url))
        self.entered.set()
        assert self.unblocked.wait(10)
