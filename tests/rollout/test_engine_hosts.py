"""Engines and the router across hosts, on loopback (fast, no Ray, no sglang):

addresses     `miles.utils.net`'s rules (loopback, wildcard, advertised, auto) and `interface_for`
router        bound on one address, handing out its advertised one
recovery      an engine the router took out: healthy on its host but unreachable from the manager's (a real
              HTTP server on 127.0.0.2 that its "actor" checks there, advertised where nothing listens) ends the
              job in one line and is never restarted; a passing failure goes back into the router; restarts stop
              at --max-engine-restarts
failure text  a server start failure raised in an actor's constructor keeps its cause
relocation    a restart whose placement-group bundle's node is dead goes anywhere alive
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from miles.rollout.engines.failure_text import first_line, raised_text, with_cause
from miles.rollout.engines.sglang.engine import check_locally
from miles.rollout.engines.sglang.recovery import (
    ACTOR_LOST,
    SERVER_DOWN,
    TRANSIENT,
    UNREACHABLE,
    ActorUnanswered,
    EngineRecovery,
    unreachable_line,
)
from miles.rollout.engines.sglang.router import MilesRouter, RouterConfig
from miles.rollout.engines.sglang.server import ServerSpec, free_port
from miles.utils.net import (
    advertised_host,
    host_of,
    http_url,
    interface_for,
    is_loopback,
    is_wildcard,
    local_host,
    resolve_bind_host,
    url_host,
)

# ---------------------------------------------------------------------------- addresses


def test_loopback_and_wildcard_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1", "[::1]", " 127.0.0.1 "):
        assert is_loopback(host) and not is_wildcard(host), host
    for host in ("0.0.0.0", "::", "[::]", ""):
        assert is_wildcard(host) and not is_loopback(host), host
    for host in ("10.0.0.5", "192.0.2.2", "fd00::2", "node-7.cluster"):
        assert not is_loopback(host) and not is_wildcard(host), host


def test_advertised_host_is_what_the_others_can_reach() -> None:
    assert advertised_host("127.0.0.1", "10.0.0.5") == "127.0.0.1"  # loopback: itself (its host only)
    assert advertised_host("localhost", "10.0.0.5") == "localhost"
    assert advertised_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"  # wildcard: the node's own IP, never 0.0.0.0
    assert advertised_host("::", "10.0.0.5") == "10.0.0.5"
    assert advertised_host("", "10.0.0.5") == "10.0.0.5"
    assert advertised_host("10.0.0.7", "10.0.0.5") == "10.0.0.7"  # a specific address: itself
    assert advertised_host("[fd00::7]", "10.0.0.5") == "fd00::7"
    assert local_host("0.0.0.0") == "127.0.0.1" and local_host("::") == "::1" and local_host("10.0.0.7") == "10.0.0.7"


def test_auto_binds_the_node_address_on_several_nodes_only() -> None:
    assert resolve_bind_host("auto", "10.0.0.5", alive_nodes=1) == "127.0.0.1"
    assert resolve_bind_host("auto", "10.0.0.5", alive_nodes=3) == "10.0.0.5"
    assert resolve_bind_host(None, "10.0.0.5", alive_nodes=2) == "10.0.0.5"
    assert resolve_bind_host(" AUTO ", "10.0.0.5", alive_nodes=1) == "127.0.0.1"
    assert resolve_bind_host("0.0.0.0", "10.0.0.5", alive_nodes=3) == "0.0.0.0"  # anything else: the bind itself
    assert resolve_bind_host("127.0.0.1", "10.0.0.5", alive_nodes=3) == "127.0.0.1"


def test_urls_and_interfaces() -> None:
    assert url_host("fd00::2") == "[fd00::2]" and url_host("10.0.0.5") == "10.0.0.5"
    assert http_url("::1", 80) == "http://[::1]:80" and http_url("10.0.0.5", 8) == "http://10.0.0.5:8"
    assert host_of("http://[fd00::2]:30000/health") == "fd00::2" and host_of("http://10.0.0.5:1") == "10.0.0.5"
    import psutil

    assert interface_for("127.0.0.1") in psutil.net_if_addrs()  # the loopback interface ("lo" on Linux)
    assert interface_for("203.0.113.77") is None  # TEST-NET-3: no interface of this host has it


def test_a_wildcard_server_is_advertised_and_reached_locally() -> None:
    spec = ServerSpec(python="p", model_path="m", host="0.0.0.0", port=30000, advertise_host="10.0.0.5")
    assert spec.url == "http://10.0.0.5:30000" and spec.local_url == "http://127.0.0.1:30000"
    bare = ServerSpec(python="p", model_path="m", port=30000)
    assert bare.url == bare.local_url == "http://127.0.0.1:30000"
    port = free_port(pair=True, host="127.0.0.2")  # a free port on the address the server will bind
    assert 1024 <= port < 65535


# ---------------------------------------------------------------------------- router


def test_the_router_binds_one_address_and_hands_out_its_advertised_one() -> None:
    router = MilesRouter(RouterConfig(host="0.0.0.0", advertise_host="127.0.0.2", health_check_interval=0))
    try:
        router.start()
        port = int(router.url.rsplit(":", 1)[1])
        assert router.url == f"http://127.0.0.2:{port}"  # what the engines' clients and other hosts are told
        assert router.local_url == f"http://127.0.0.1:{port}"
        for url in (router.url, router.local_url):  # bound on every interface: both reach it
            assert requests.get(url + "/health", timeout=5).status_code == 503  # no engine yet
    finally:
        router.stop()
    loopback = MilesRouter(RouterConfig(host="127.0.0.2", health_check_interval=0))
    try:
        loopback.start()
        assert loopback.url.startswith("http://127.0.0.2:") and loopback.local_url == loopback.url
        port = int(loopback.url.rsplit(":", 1)[1])
        with pytest.raises(requests.ConnectionError):  # bound on 127.0.0.2 only
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        loopback.stop()


# ---------------------------------------------------------------------------- recovery


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server_on_127_0_0_2() -> Iterator[str]:
    """A healthy "engine server" bound to 127.0.0.2 only: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.2:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class Side:
    """The engines as the recovery sees them: engine 0 advertised at `url`, its "actor" on node `node_ip` checking
    its server at `local_url` with the very function the real actor runs (`check_locally`)."""

    def __init__(self, url: str, local_url: str, exit_code: int | None = None, lost: bool = False) -> None:
        self.url, self.local_url, self.exit_code, self.lost = url, local_url, exit_code, lost
        self.node_ip = "127.0.0.2"
        self.restarts: list[tuple[int, bool]] = []
        self.readded: list[int] = []
        self.router: MilesRouter | None = None

    def engine_url(self, i: int) -> str:
        return self.url

    def describe(self, i: int) -> str:
        return f"sglang engine {i} at {self.url} (pid 1, log x)"

    def local_health(self, i: int) -> dict[str, Any]:
        if self.lost:
            raise ActorUnanswered("its actor is gone: The actor died because its node has died")
        return check_locally(self.local_url, self.exit_code, self.node_ip, timeout=2.0)

    def restart_engine(self, i: int, reason: str, replace_actor: bool) -> None:
        self.restarts.append((i, replace_actor))

    def readd_engine(self, i: int) -> None:
        self.readded.append(i)
        if self.router is not None:
            self.router.add_worker(self.url)


def _recovery(side: Side, fault_tolerant: bool = True, max_restarts: int = 3) -> EngineRecovery:
    return EngineRecovery(side, 1, lambda: fault_tolerant, max_restarts, timeout=2.0, manager_ip="127.0.0.1")


def _wait(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_healthy_on_its_host_but_unreachable_ends_the_job_without_a_restart(server_on_127_0_0_2: str) -> None:
    port = int(server_on_127_0_0_2.rsplit(":", 1)[1])
    advertised = f"http://127.0.0.3:{port}"  # what the manager was told: nothing listens there
    side = Side(advertised, server_on_127_0_0_2)
    recovery = _recovery(side)
    router = MilesRouter(
        RouterConfig(health_check_interval=0.1, health_check_timeout=2.0, failure_threshold=2),
        on_engine_removed=lambda url, reason: recovery.on_removed(0, reason),
    )
    router.add_worker(advertised)
    router.start()
    try:
        _wait(lambda: recovery.first_failure() is not None)
        line = recovery.first_failure()
        assert line == (
            f"sglang engine 0 on 127.0.0.2 is healthy on its host but {advertised} is unreachable from the rollout "
            "manager's host 127.0.0.1: check --rollout-engine-host and the firewall"
        )
        assert line == unreachable_line(0, "127.0.0.2", advertised, "127.0.0.1")
        time.sleep(0.5)  # more health rounds: still no restart, and the engine stays out
        assert side.restarts == [] and side.readded == [] and router.workers() == []
        assert recovery.diagnose(0).kind == UNREACHABLE
    finally:
        router.stop()


def test_without_fault_tolerance_unreachable_is_the_same_line(server_on_127_0_0_2: str) -> None:
    side = Side("http://127.0.0.3:9", server_on_127_0_0_2)
    recovery = _recovery(side, fault_tolerant=False)
    recovery.on_removed(0, "failed 3 consecutive health checks")
    assert "is healthy on its host but http://127.0.0.3:9 is unreachable" in (recovery.first_failure() or "")
    assert "--use-fault-tolerance" not in (recovery.first_failure() or "")  # a restart would not mend it


def test_a_passing_failure_puts_the_engine_back_without_a_restart(server_on_127_0_0_2: str) -> None:
    side = Side(server_on_127_0_0_2, server_on_127_0_0_2)  # reachable from here as well
    recovery = _recovery(side)
    router = MilesRouter(RouterConfig(health_check_interval=0))
    side.router = router
    router.start()
    try:
        router.add_worker(side.url)
        router.remove_worker(side.url)  # as a dropped connection would
        recovery.on_removed(0, "connection failed: ServerDisconnectedError")
        assert recovery.diagnose(0).kind == TRANSIENT
        assert side.readded == [0] and side.restarts == [] and recovery.first_failure() is None
        assert router.workers() == [side.url]
    finally:
        router.stop()


def test_a_dead_server_is_restarted_up_to_the_cap_then_ends_the_job() -> None:
    side = Side("http://127.0.0.3:9", "http://127.0.0.3:9", exit_code=-9)
    recovery = _recovery(side, max_restarts=2)
    assert recovery.diagnose(0).kind == SERVER_DOWN
    for _ in range(2):
        recovery.on_removed(0, "failed 3 consecutive health checks")
    assert side.restarts == [(0, False), (0, False)] and recovery.first_failure() is None
    recovery.on_removed(0, "failed 3 consecutive health checks")
    assert side.restarts == [(0, False), (0, False)]  # no third restart
    assert recovery.first_failure() == (
        "sglang engine 0 at http://127.0.0.3:9 (pid 1, log x) failed again after 2 restarts in this job "
        "(--max-engine-restarts 2): failed 3 consecutive health checks; its server exited with code -9"
    )
    none = _recovery(Side("http://127.0.0.3:9", "http://127.0.0.3:9", exit_code=1), max_restarts=0)
    none.on_removed(0, "connection failed")
    assert (none.first_failure() or "").endswith("--max-engine-restarts 0 allows no restart")
    assert none.side.restarts == []  # type: ignore[attr-defined]


def test_a_lost_actor_is_replaced_and_without_fault_tolerance_named() -> None:
    side = Side("http://127.0.0.3:9", "http://127.0.0.3:9", lost=True)
    recovery = _recovery(side)
    assert recovery.diagnose(0).kind == ACTOR_LOST
    recovery.on_removed(0, "failed 3 consecutive health checks")
    assert side.restarts == [(0, True)]  # a new actor, not a server restart in the dead one
    off = _recovery(Side("http://127.0.0.3:9", "http://127.0.0.3:9", exit_code=-9), fault_tolerant=False)
    off.on_removed(0, "connection failed: ClientConnectorError")
    assert off.first_failure() == (
        "sglang engine 0 at http://127.0.0.3:9 (pid 1, log x) failed: connection failed: ClientConnectorError; "
        "its server exited with code -9. Pass --use-fault-tolerance to restart dead engines and go on."
    )


def test_a_failed_restart_keeps_its_cause() -> None:
    class Failing(Side):
        def restart_engine(self, i: int, reason: str, replace_actor: bool) -> None:
            raise RuntimeError(
                "sglang engine 0 exited with code 1 while starting (log /o/engines/sglang_engine_0.log):\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nline 1\nline 2"
            )

    recovery = _recovery(Failing("http://127.0.0.3:9", "http://127.0.0.3:9", exit_code=-9))
    recovery.on_removed(0, "connection failed")
    line = recovery.first_failure() or ""
    assert "restart failed: sglang engine 0 exited with code 1 while starting" in line
    assert line.endswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


# ---------------------------------------------------------------------------- failure text


class _Dead(Exception):
    """What Ray raises for an actor whose constructor raised: only text, no `.cause` (Ray 2.60's layout)."""


CREATION = (
    "The actor died because of an error raised in its creation task, ray::SglangEngine.__init__() "
    "(pid=4242, ip=10.0.0.12, actor_id=ab12, repr=<SglangEngine object>)\n"
    '  File "/miles/rollout/engines/sglang/engine.py", line 40, in __init__\n'
    "    self.start_seconds = self._launch()\n"
    '  File "/miles/rollout/engines/sglang/server.py", line 190, in wait_ready\n'
    "    raise EngineStartError(\n"
    "miles.rollout.engines.sglang.server.EngineStartError: sglang engine 1 exited with code 1 while starting "
    "(log /o/engines/sglang_engine_1.log):\n"
    "ValueError: model_id 'x' is not a known pipeline\n"
    "Loading pipeline...\n"
    "ValueError: model_id 'x' is not a known pipeline"
)


def test_a_start_failure_in_an_actor_constructor_keeps_its_cause() -> None:
    exc = _Dead(CREATION)
    assert raised_text(exc).startswith("sglang engine 1 exited with code 1 while starting")
    assert with_cause(exc) == (
        "sglang engine 1 exited with code 1 while starting (log /o/engines/sglang_engine_1.log): "
        "ValueError: model_id 'x' is not a known pipeline"
    )
    assert first_line(exc) == (
        "sglang engine 1 exited with code 1 while starting (log /o/engines/sglang_engine_1.log):"
    )
    chained = _Dead(
        CREATION.replace(
            "miles.rollout",
            "During handling of the above exception, another exception occurred:\nRuntimeError: first\nmiles.rollout",
            1,
        )
    )
    assert raised_text(chained).startswith("first")  # the error raised last
    quiet = RuntimeError("sglang engine 2 at http://h:1 was not healthy after 600 s (log x):\nstep 3/9\nstep 4/9")
    assert with_cause(quiet).endswith("last log line: step 4/9")  # no error line: the last line of the tail


# ---------------------------------------------------------------------------- relocation


class _Group:
    id = "pg"


def test_a_restart_leaves_a_bundle_whose_node_is_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.util
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.rollout.engines import relocation

    options = {"scheduling_strategy": PlacementGroupSchedulingStrategy(_Group(), 1), "num_gpus": 1.0, "num_cpus": 0.01}
    table = {"state": "CREATED", "bundles_to_node_id": {0: "node-a", 1: "node-b"}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda group: table)
    monkeypatch.setattr(relocation, "alive_node_ids", lambda: {"node-a", "node-b"})
    assert relocation.live_options(options) == (options, None)  # alive: its own bundle
    monkeypatch.setattr(relocation, "alive_node_ids", lambda: {"node-a", "node-c"})
    moved, note = relocation.live_options(options)
    assert moved == {"num_gpus": 1.0, "num_cpus": 0.01}  # the same resources, anywhere alive
    assert note is not None and "node node-b is gone" in note
    table["bundles_to_node_id"] = {0: "node-a"}  # Ray no longer assigns the bundle to any node
    assert relocation.live_options(options)[0] == {"num_gpus": 1.0, "num_cpus": 0.01}
    plain = {"num_cpus": 0}
    assert relocation.live_options(plain) == (plain, None)  # no bundle: nothing to move


def test_an_actor_waiting_for_a_bundle_whose_node_dies_is_started_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor's death is often known before its node's: the restart first goes into the bundle, then moves once
    Ray lists the node dead while the actor still waits there."""
    import ray

    from miles.rollout.engines import relocation

    bundle = {"scheduling_strategy": "bundle 0 on node-b", "num_gpus": 1.0}
    anywhere = {"num_gpus": 1.0}
    looks = iter([(bundle, None), (bundle, None), (anywhere, "node node-b is gone: placed on any alive node")])
    monkeypatch.setattr(relocation, "live_options", lambda options: next(looks))
    made: list[dict[str, Any]] = []
    killed: list[str] = []
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([r for r in refs if r == "answer of actor 1"], []))
    monkeypatch.setattr(ray, "get", lambda ref: {"pid": 7} if ref == "answer of actor 1" else None)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))

    def make(options: dict[str, Any]) -> str:
        made.append(options)
        return f"actor {len(made) - 1}"

    actor, answer, note = relocation.start_placed(bundle, make, lambda a: f"answer of {a}", poll=0.0)
    assert (actor, answer) == ("actor 1", {"pid": 7}) and made == [bundle, anywhere] and killed == ["actor 0"]
    assert note is not None and "node-b is gone" in note

    monkeypatch.setattr(relocation, "live_options", lambda options: (options, None))  # its node lives: it waits
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([], refs))
    with pytest.raises(TimeoutError):
        relocation.start_placed(bundle, make, lambda a: f"answer of {a}", timeout=0.05, poll=0.01)
