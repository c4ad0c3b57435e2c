"""The driver's host watch, the actors' lifeline and the rollout manager's node, on real Ray clusters of this
machine (a simulated second node stands in for another host; the hosts tier, tests/hosts, runs them on real
separate addresses)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from miles.config.jobs import JOBS
from miles.core.errors import ConfigError
from miles.placement import manager_node
from miles.runtime import host_watch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def two_nodes(head):
    """The module's head and a second node (resource `other_host`), removed after the test if still there."""
    worker = head.add_node(num_cpus=1, resources={"other_host": 1})
    head.wait_for_nodes()
    try:
        yield head, worker
    finally:
        host_watch.reset()
        if worker in head.worker_nodes:
            head.remove_node(worker, allow_graceful=False)


def _other(ray) -> dict:
    return next(n for n in ray.nodes() if n["Alive"] and "other_host" in n["Resources"])


def test_a_lost_node_interrupts_the_drivers_wait_with_one_line_naming_it(two_nodes) -> None:
    import ray

    cluster, worker = two_nodes
    other = _other(ray)
    hosts = {other["NodeID"]: ("10.9.9.9", ["actor 1", "engine 0"], False)}
    watch = host_watch.HostWatch(hosts, timeout=4.0, grace=60.0).start()  # timeout: --host-timeout

    @ray.remote(num_cpus=0, resources={"other_host": 1})
    def forever() -> None:
        time.sleep(3600)

    ref = forever.remote()
    time.sleep(2.0)
    start = time.monotonic()
    cluster.remove_node(worker, allow_graceful=False)
    with pytest.raises(KeyboardInterrupt):  # HostLost, passed on by Ray's signal check as a KeyboardInterrupt
        ray.get(ref)
    watch.stop(failing=True)
    host_watch.settle()
    lost = host_watch.lost()
    assert lost is not None and lost.address == "10.9.9.9"
    assert lost.line.startswith("host 10.9.9.9 lost: ") and lost.line.endswith("actor 1, engine 0 ran there")
    assert time.monotonic() - start < 15


def test_an_engine_only_host_under_fault_tolerance_is_said_and_does_not_end_the_job(two_nodes, capsys) -> None:
    import ray

    cluster, worker = two_nodes
    other = _other(ray)
    hosts = {other["NodeID"]: ("10.9.9.9", ["engine 0"], True)}
    watch = host_watch.HostWatch(hosts, timeout=4.0, grace=60.0).start()
    time.sleep(1.5)
    cluster.remove_node(worker, allow_graceful=False)
    deadline = time.monotonic() + 15
    while not watch.hosts[other["NodeID"]].gone:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    watch.stop()
    assert host_watch.lost() is None  # covered: no failure
    said = capsys.readouterr().out
    assert "host 10.9.9.9 lost: " in said and "its engines are re-placed on live hosts (--use-fault-tolerance)" in said


def test_the_manager_node_is_the_drivers_the_heads_or_an_address_and_a_wrong_one_is_refused(head) -> None:
    import ray

    driver_node = ray.get_runtime_context().get_node_id()
    assert manager_node.find_node("driver")[0] == driver_node
    head = manager_node.find_node("head")
    assert head[0] == driver_node  # the driver runs on the head here
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert manager_node.find_node(head[1])[0] in alive  # both nodes share this machine's address here
    with pytest.raises(ConfigError, match=r"--rollout-manager-node 10\.250\.0\.1: no alive Ray node"):
        manager_node.find_node("10.250.0.1")
    line = manager_node.describe(SimpleNamespace(rollout_manager_node="head", train_only=False), JOBS["rl"])
    assert line == "rollout manager: Ray's head node (--rollout-manager-node head)"
    assert manager_node.describe(SimpleNamespace(rollout_manager_node="driver"), JOBS["sft"]) is None


def test_an_actor_cut_off_from_the_head_exits_after_the_host_timeout(tmp_path) -> None:
    """The lifeline in a process whose 'head' stops accepting connections: it exits 1 after the timeout."""
    code = f"""
import socket, sys, time
sys.path.insert(0, {str(sys.path[0])!r})
from miles.utils import lifeline
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
port = server.getsockname()[1]
lifeline.head_address = lambda: ("127.0.0.1", port)
lifeline.start(2.0, "test actor", interval=0.2, on_exit=lambda reason: print("last words:", reason, flush=True))
time.sleep(1.0)
server.close()  # the head is gone
start = time.monotonic()
time.sleep(30)
print("still alive", flush=True)
"""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert "has been unreachable for 2 s (--host-timeout)" in done.stderr
    assert "still alive" not in done.stdout
    assert "last words: the Ray head 127.0.0.1:" in done.stdout
    assert took < 15


def test_a_lifeline_needs_failed_probes_in_a_row_not_only_a_long_gap() -> None:
    from miles.utils.lifeline import Watch

    watch = Watch(timeout=8.0, now=0.0)
    assert not watch.observe(True, 1.0)
    # a process starved for 20 s wakes to one failed probe: a gap, not yet a cut-off
    assert not watch.observe(False, 21.0)
    assert not watch.observe(False, 22.0)
    assert watch.observe(False, 23.0)  # the third in a row, 22 s after the last answer
    watch = Watch(timeout=8.0, now=0.0)
    for now in range(1, 8):
        assert not watch.observe(False, float(now))  # failing, but not yet for the timeout
    assert not watch.observe(True, 8.5)  # one answer starts the count again
    assert not any(watch.observe(False, 9.0 + i) for i in range(8))
    assert watch.observe(False, 17.5)
