"""Tests of the miles router over real HTTP: real aiohttp backends on free ports, a real router, real clients."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import requests
from aiohttp import web

from miles.rollout.router import ENGINE_HEADER, MilesRouter, RouterConfig

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


# ---------------------------------------------------------------------------- fixtures


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


# ---------------------------------------------------------------------------- tests


def test_sequential_requests_spread_evenly_and_round_trip_exactly(make_backends, make_router) -> None:
    backends = make_backends(4)
    by_url = {b.url: b for b in backends}
    router = make_router(backends)
    assert router.url.startswith("http://127.0.0.1:")
    assert router.workers() == [b.url for b in backends]

    rng = random.Random(0)
    big = rng.randbytes(1_200_000)  # above aiohttp's default 1 MiB request limit
    content_types = ["application/msgpack", "application/octet-stream", "text/plain; charset=utf-8"]
    for i in range(40):
        request = {"prompt": f"a photo of {i}", "seed": i, "latents": rng.randbytes(64)}
        body = big if i == 7 else msgpack.packb(request)
        content_type = content_types[i % len(content_types)]
        resp = post(router, body, path=f"{GENERATE}?i={i}", content_type=content_type)
        assert resp.status_code == 200
        backend = by_url[resp.headers[ENGINE_HEADER]]
        assert backend.seen[-1] == ("POST", f"{GENERATE}?i={i}", content_type, body)
        assert resp.headers["Content-Type"] == content_type
        assert "X-Not-Forwarded" not in resp.headers
        assert resp.content == backend.name.encode() + b"|" + body
        if i != 7:
            assert msgpack.unpackb(resp.content[2:])["seed"] == i

    assert [b.served for b in backends] == [10, 10, 10, 10]
    stats = router.stats()
    assert [stats[b.url] for b in backends] == [{"served": 10, "active": 0, "failures": 0, "errors": 0}] * 4

    # Any method and path is proxied; a request without a body keeps having none.
    resp = call("GET", router.url + "/model_info?x=1", content_type=None)
    assert resp.status_code == 200
    backend = by_url[resp.headers[ENGINE_HEADER]]
    assert backend.seen[-1] == ("GET", "/model_info?x=1", None, b"")
    assert resp.content == backend.name.encode() + b"|"


def test_concurrency_cap_queues_requests(make_backends, make_router) -> None:
    (backend,) = make_backends(1)
    backend.delay = 0.1
    router = make_router([backend], concurrency=2)
    start = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda i: post(router, f"req{i}".encode()), range(6)))
    elapsed = time.monotonic() - start
    assert [r.status_code for r in responses] == [200] * 6
    assert sorted(r.content for r in responses) == sorted(f"a|req{i}".encode() for i in range(6))
    assert backend.max_in_flight == 2
    assert backend.served == 6
    assert elapsed >= 0.28  # three waves of two
    assert router.stats()[backend.url] == {"served": 6, "active": 0, "failures": 0, "errors": 0}


def test_least_loaded_engine_is_chosen(make_backends, make_router) -> None:
    busy, idle = make_backends(2)
    router = make_router([busy, idle])
    busy.hold()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, router, b"slow")
        wait_for(lambda: busy.in_flight == 1, what="the slow request to reach the first engine")
        assert router.stats()[busy.url]["active"] == 1
        for i in range(5):
            resp = post(router, f"fast{i}".encode())
            assert resp.headers[ENGINE_HEADER] == idle.url
        assert idle.served == 5
        busy.release()
        assert slow.result(10).content == b"a|slow"
    assert busy.served == 1
    assert router.stats()[busy.url]["active"] == 0


def test_health_checks_remove_engine_after_exactly_threshold_failures(make_backends, make_router) -> None:
    sick, well1, well2 = make_backends(3)
    sick.health_status = 503
    sick.hold_health(3)  # the third check is parked at the backend until released
    removals = Removals()
    removals.extra = lambda url: sick.health_hits
    router = make_router(
        [sick, well1, well2], on_removed=removals, health_check_interval=0.05, health_check_timeout=5.0,
        failure_threshold=3,
    )  # fmt: skip

    wait_for(lambda: sick.health_hits == 3, what="three health checks")
    # Two failed checks so far: still routable, still served.
    assert router.stats()[sick.url]["failures"] == 2
    assert sick.url in router.workers()
    assert removals.calls == []
    served = {post(router).headers[ENGINE_HEADER] for _ in range(3)}
    assert served == {sick.url, well1.url, well2.url}

    sick.release_health()  # the third check now fails
    assert removals.entered.wait(5)
    reason = "failed 3 consecutive health checks"
    assert removals.calls == [(sick.url, reason)]
    assert removals.extras == [3]
    assert removals.threads[0].startswith("miles-router-callback")
    assert router.removed() == {sick.url: reason}
    assert router.workers() == [well1.url, well2.url]
    assert router.stats()[sick.url]["failures"] == 3
    healthy_hits = well1.health_hits

    before = sick.served
    for _ in range(6):
        assert post(router).headers[ENGINE_HEADER] in (well1.url, well2.url)
    assert sick.served == before
    wait_for(lambda: well1.health_hits >= healthy_hits + 2, what="more health rounds")
    assert sick.health_hits == 3  # removed engines are no longer checked
    assert router.stats()[well1.url]["failures"] == 0
    assert len(removals.calls) == 1


def test_successful_health_check_resets_failure_count(make_backends, make_router) -> None:
    (flaky,) = make_backends(1)
    flaky.health_status = 500
    flaky.hold_health(3)
    removals = Removals()
    router = make_router([flaky], on_removed=removals, health_check_interval=0.05, failure_threshold=3)
    wait_for(lambda: flaky.health_hits == 3, what="three health checks")
    assert router.stats()[flaky.url]["failures"] == 2
    flaky.health_status = 200
    flaky.release_health()
    wait_for(lambda: router.stats()[flaky.url]["failures"] == 0, what="the failure count to reset")
    wait_for(lambda: flaky.health_hits >= 6, what="more health rounds")
    assert router.stats()[flaky.url]["failures"] == 0
    assert router.workers() == [flaky.url]
    assert removals.calls == []


@pytest.mark.parametrize("when", ["in_flight", "idle"])
def test_dead_engine_is_removed_and_request_retried(make_backends, make_router, when: str) -> None:
    doomed, survivor = make_backends(2)
    removals = Removals(block=True)  # a callback stuck for a while must not stall the router
    router = make_router([doomed, survivor], on_removed=removals)
    assert [post(router).headers[ENGINE_HEADER] for _ in range(2)] == [doomed.url, survivor.url]

    if when == "in_flight":
        doomed.hold()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, router, b"retry me")
            wait_for(lambda: doomed.in_flight == 1, what="the request to reach the doomed engine")
            doomed.shutdown()
            resp = pending.result(10)
    else:
        doomed.shutdown()
        resp = post(router, b"retry me")  # round-robin sends it to the dead engine first
    assert resp.status_code == 200
    assert resp.headers[ENGINE_HEADER] == survivor.url
    assert resp.content == b"b|retry me"

    assert removals.entered.wait(5)
    for _ in range(4):  # the router keeps serving while the callback is blocked
        assert post(router).headers[ENGINE_HEADER] == survivor.url
    removals.unblocked.set()

    assert len(removals.calls) == 1
    url, reason = removals.calls[0]
    assert url == doomed.url
    assert reason.startswith("connection failed: ")
    assert router.removed() == {doomed.url: reason}
    assert router.workers() == [survivor.url]
    stats = router.stats()
    assert stats[doomed.url]["errors"] == 1
    assert stats[doomed.url]["served"] == 1
    assert stats[survivor.url] == {"served": 6, "active": 0, "failures": 0, "errors": 0}


def test_all_engines_dead_returns_503_naming_them(make_backends, make_router) -> None:
    backends = make_backends(3)
    removals = Removals()
    router = make_router(backends, on_removed=removals, max_retries=2)
    for _ in range(3):
        assert post(router).status_code == 200
    for backend in backends:
        backend.shutdown()

    resp = post(router)
    assert resp.status_code == 503
    payload = resp.json()
    assert set(payload["engines"]) == {b.url for b in backends}
    assert all(reason.startswith("connection failed: ") for reason in payload["engines"].values())
    assert "3 engine(s)" in payload["error"]
    assert router.workers() == []
    wait_for(lambda: len(removals.calls) == 3, what="three callbacks")
    assert sorted(removals.calls) == sorted(payload["engines"].items())

    resp = post(router)  # nothing left to try
    assert resp.status_code == 503
    assert resp.json() == {"error": "no routable engines", "engines": router.removed()}
    assert call("GET", router.url + "/health").status_code == 503


def test_retries_are_bounded_by_max_retries(make_backends, make_router) -> None:
    backends = make_backends(4)
    router = make_router(backends, max_retries=1)
    for backend in backends:
        backend.shutdown()
    resp = post(router)
    assert resp.status_code == 503
    assert set(resp.json()["engines"]) == {backends[0].url, backends[1].url}
    assert router.workers() == [backends[2].url, backends[3].url]


def test_http_error_status_is_passed_through(make_backends, make_router) -> None:
    failing, fine = make_backends(2)
    failing.status = 500
    removals = Removals()
    router = make_router([failing, fine], on_removed=removals)
    resp = post(router, b"boom", content_type="application/msgpack")
    assert resp.status_code == 500
    assert resp.content == b"a|boom"
    assert resp.headers["Content-Type"] == "application/msgpack"
    assert resp.headers[ENGINE_HEADER] == failing.url
    assert failing.served == 1  # not retried
    assert fine.served == 0
    assert router.workers() == [failing.url, fine.url]
    assert router.stats()[failing.url] == {"served": 1, "active": 0, "failures": 0, "errors": 0}
    assert post(router).headers[ENGINE_HEADER] == fine.url
    assert removals.calls == []


def test_worker_management_over_http(make_backends, make_router) -> None:
    a, b = make_backends(2)
    removals = Removals()
    router = make_router(on_removed=removals)
    base = router.url
    assert call("GET", base + "/health").status_code == 503
    assert post(router).status_code == 503
    assert call("GET", base + "/list_workers").json() == {"workers": [], "removed": {}}

    assert call("POST", f"{base}/add_worker?url={a.url}/").status_code == 200  # trailing slash is normalized
    assert call("POST", f"{base}/add_worker?url={b.url}").status_code == 200
    assert call("GET", base + "/health").status_code == 200
    assert call("GET", base + "/list_workers").json() == {"workers": [a.url, b.url], "removed": {}}
    assert {post(router).headers[ENGINE_HEADER] for _ in range(4)} == {a.url, b.url}

    assert call("POST", f"{base}/remove_worker?url={a.url}").status_code == 200
    reason = "removed by remove_worker"
    assert call("GET", base + "/list_workers").json() == {"workers": [b.url], "removed": {a.url: reason}}
    assert {post(router).headers[ENGINE_HEADER] for _ in range(4)} == {b.url}
    assert router.stats()[a.url]["served"] == 2

    assert call("POST", f"{base}/add_worker?url={a.url}").status_code == 200  # revived, counters reset
    assert router.workers() == [b.url, a.url]
    assert router.removed() == {}
    assert router.stats()[a.url] == {"served": 0, "active": 0, "failures": 0, "errors": 0}
    assert {post(router).headers[ENGINE_HEADER] for _ in range(4)} == {a.url, b.url}

    router.remove_worker(b.url)  # the Python API does the same
    assert router.workers() == [a.url]
    router.add_worker(b.url)
    assert router.workers() == [a.url, b.url]

    assert call("POST", base + "/add_worker").status_code == 400
    assert call("POST", base + "/add_worker?url=not-a-url").status_code == 400
    assert call("POST", base + "/remove_worker?url=http://127.0.0.1:1").status_code == 404
    assert removals.calls == []  # deliberate removals do not fire the callback


def test_timeout_returns_504_naming_engine(make_backends, make_router) -> None:
    slow, other = make_backends(2)
    slow.hold()
    router = make_router([slow, other], timeout=0.2)
    start = time.monotonic()
    resp = post(router)
    assert time.monotonic() - start < 2.0
    assert resp.status_code == 504
    assert resp.headers[ENGINE_HEADER] == slow.url
    payload = resp.json()
    assert slow.url in payload["error"]
    assert payload["engines"] == {slow.url: "timed out after 0.2 s"}
    assert other.served == 0  # not retried
    assert router.workers() == [slow.url, other.url]  # not removed
    assert router.stats()[slow.url]["errors"] == 0
    slow.release()
    assert post(router).headers[ENGINE_HEADER] == other.url
    assert post(router).status_code == 200


def test_stop_is_idempotent_and_frees_port(make_backends) -> None:
    (backend,) = make_backends(1)
    MilesRouter(RouterConfig()).stop()  # never started: nothing to do
    router = MilesRouter(RouterConfig(), on_engine_removed=None)
    router.add_worker(backend.url)
    url = router.start()
    assert post(router).status_code == 200
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="already started"):
        router.start()
    with pytest.raises(OSError):  # the port is taken while the router runs
        MilesRouter(RouterConfig(port=port)).start()
    router.stop()
    router.stop()
    with pytest.raises(requests.ConnectionError):
        call("GET", url + "/health", timeout=2)

    again = MilesRouter(RouterConfig(port=port))
    try:
        assert again.start() == url
        again.add_worker(backend.url)
        assert post(again).status_code == 200
    finally:
        again.stop()
    with socket.socket() as sock:  # and the port is free once more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
