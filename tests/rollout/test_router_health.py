"""The miles router when engines fail, over real HTTP: health checks, dead engines, retries, error statuses and
timeouts."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from router_helpers import Removals, call, post, wait_for

from miles.rollout.engines.sglang.router import ENGINE_HEADER


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
