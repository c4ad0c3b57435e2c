"""Tests of the miles router over real HTTP: real aiohttp backends on free ports, a real router, real clients:
spreading, queueing, least-loaded choice, worker management and shutdown."""

from __future__ import annotations

import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import requests
from router_helpers import GENERATE, Removals, call, post, wait_for

from miles.rollout.engines.sglang.router import ENGINE_HEADER, MilesRouter, RouterConfig


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
