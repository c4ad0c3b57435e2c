"""The driver's watch over the hosts a job runs on: a lost host ends the job within `--host-timeout`, in one line.

Ray notices a host whose processes died within seconds, but one whose link went down only after its own node
timeout (about a minute), and until then every wait on that host's actors hangs. The watch pins a tiny probe
actor on each host of the job and pings it every second; a host is lost when Ray reports its node dead or when
its probe has not answered for `--host-timeout` seconds. Then the watch interrupts the driver's main thread
(SIGUSR1, like Ctrl-C wakes a wait on an actor), which raises `HostLost`; the `miles` command exits 15 s later
if the driver has not ended by then; the job's `finally` blocks stop the
actors, and the failure line names the host and what ran there, whatever error Ray raised first.

Under `--use-fault-tolerance` a host that held only rollout engines is covered: its loss is said and the engine
supervisor re-places the engines on live nodes; the job goes on.

Actors on a host cut off from the head exit by themselves after the same timeout (`miles.utils.lifeline`), so
nothing of the job keeps running there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SIGNAL = signal.SIGUSR1
_LOST: HostLost | None = None  # the first host lost in this driver (read by the failure report)


class HostLost(KeyboardInterrupt):
    """A host of the job was lost; `line` says which, why and what ran there. A KeyboardInterrupt, as
    `JobInterrupted` is: a wait in Ray wakes for it (Ray's signal check passes only that class on), and no
    `except Exception` on the way swallows it."""

    def __init__(self, address: str, why: str, held: list[str]) -> None:
        self.address = address
        self.why = why
        self.held = held
        ran = f"; {', '.join(held)} ran there" if held else ""
        super().__init__(f"host {address} lost: {why}{ran}")

    @property
    def line(self) -> str:
        return str(self)


def lost() -> HostLost | None:
    return _LOST


def reset() -> None:
    global _LOST
    _LOST = None
    settle()


_EXIT_TIMER: threading.Timer | None = None
FORCE_EXIT = False  # set by the `miles` command (`miles_cli.main.entry`): never in a process that runs jobs in-process


def _arm_exit(grace: float, final_line: Callable[[HostLost], str]) -> None:
    """If the driver has not ended the job `grace` seconds after a host was lost (a wait on the lost host's
    actors that no signal wakes, a shutdown that hangs on them), say the failure line and exit 1 from here: the
    driver's death ends its actors on every host Ray still reaches, and the lost host's end themselves."""
    global _EXIT_TIMER

    def finish() -> None:
        if _LOST is None:
            return
        print(f"miles: error: {final_line(_LOST)}", file=sys.stderr, flush=True)
        os._exit(1)

    settle()
    _EXIT_TIMER = threading.Timer(grace, finish)
    _EXIT_TIMER.daemon = True
    _EXIT_TIMER.start()


def settle() -> None:
    """The job has ended (the driver's own way): no forced exit."""
    global _EXIT_TIMER
    if _EXIT_TIMER is not None:
        _EXIT_TIMER.cancel()
        _EXIT_TIMER = None


@dataclass
class _Host:
    node_id: str
    address: str
    held: list[str]
    covered: bool  # only engines, under --use-fault-tolerance: the supervisor re-places them
    probe: Any = None
    pending: Any = None  # the ping in flight
    last_answer: float = 0.0
    answered: bool = False
    gone: bool = False


class _Probe:
    def __init__(self, timeout: float) -> None:
        from miles.utils import lifeline

        lifeline.start(timeout, "host probe")  # cut off from the head, the probe goes too

    def ping(self) -> bool:
        return True


class HostWatch:
    """Watches `hosts` (node id -> (address, what runs there, covered)) from a daemon thread."""

    def __init__(
        self,
        hosts: dict[str, tuple[str, list[str], bool]],
        timeout: float,
        final_line: Callable[[HostLost], str] = lambda lost: lost.line,
        interval: float = 1.0,
        grace: float = 15.0,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        now = time.monotonic()
        probe_cls = ray.remote(num_cpus=0)(_Probe)
        self.hosts = {
            node_id: _Host(node_id, address, held, covered, last_answer=now)
            for node_id, (address, held, covered) in hosts.items()
        }
        for host in self.hosts.values():
            strategy = NodeAffinitySchedulingStrategy(node_id=host.node_id, soft=False)
            host.probe = probe_cls.options(scheduling_strategy=strategy, max_restarts=0).remote(float(timeout))
        self.timeout = float(timeout)
        self.interval = float(interval)
        self.grace = float(grace)
        self.final_line = final_line
        self._stop = threading.Event()
        self._main: int | None = None  # the thread SIGUSR1 interrupts: the main thread, once its handler is set
        self._thread = threading.Thread(target=self._run, name="miles-host-watch", daemon=True)
        self._previous: Any = None

    # ---- the driver's side ------------------------------------------------------------------------
    def start(self) -> HostWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(_SIGNAL, self._raise)
            self._main = threading.main_thread().ident
        self._thread.start()
        return self

    def stop(self, failing: bool = False) -> None:
        """Stop watching (before the job's actors are stopped on purpose). When the job is failing, a last look
        first: Ray's node table and one more ping of every host (up to 3 s), so a lost host is named even when
        an error of one of its peers (a collective's reset connection) reached the driver first."""
        self._stop.set()
        self._thread.join(timeout=5)
        if failing and _LOST is None:
            with contextlib.suppress(Exception):
                self._last_look(min(3.0, self.timeout))
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(_SIGNAL, self._previous)
            self._previous = None

    def _last_look(self, wait: float) -> None:
        import ray

        self._check_nodes()
        # hosts whose probe has answered once: one still starting (a busy host) is not a lost one
        live = [h for h in self.hosts.values() if not h.gone and not h.covered and h.answered]
        refs = {h.node_id: h.probe.ping.remote() for h in live}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait)
        for host in live:
            ref = refs[host.node_id]
            if ref not in ready:
                self._lose(host, f"no answer from it within {wait:g} s of the job's failure")
                continue
            try:
                ray.get(ref)
            except Exception:
                self._lose(host, "the job's Ray processes there died")

    def _raise(self, signum: int, frame: Any) -> None:
        if _LOST is not None and not self._stop.is_set():  # a job already ending its own way is not interrupted
            raise _LOST

    # ---- the watch --------------------------------------------------------------------------------
    def _run(self) -> None:
        import logging

        import ray

        warned = False
        while not self._stop.wait(self.interval):
            try:
                self._check_nodes()
                self._ping()
            except Exception as exc:  # Ray shut down under the watch, or one slow answer of a busy head
                if self._stop.is_set() or not ray.is_initialized():
                    return
                if not warned:
                    logging.getLogger("miles.runtime").warning("host watch: %s (watching on)", exc)
                    warned = True

    def _check_nodes(self) -> None:
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for host in self.hosts.values():
            if not host.gone and host.node_id not in alive:
                self._lose(host, "its Ray node died (its raylet and every process of the job there are gone)")

    def _ping(self) -> None:
        import ray

        now = time.monotonic()
        for host in self.hosts.values():
            if host.gone:
                continue
            if host.pending is not None:
                done, _ = ray.wait([host.pending], timeout=0)
                if done:
                    host.pending = None
                    try:
                        ray.get(done[0])
                        host.last_answer = now
                        host.answered = True
                    except Exception:  # the probe's process is gone: so is the host's Ray (or the host)
                        self._lose(host, "the job's Ray processes there died")
                        continue
            if host.pending is None:
                host.pending = host.probe.ping.remote()
            if now - host.last_answer > self.timeout:
                self._lose(host, f"no answer from it for {self.timeout:g} s (--host-timeout)")

    def _lose(self, host: _Host, why: str) -> None:
        global _LOST
        host.gone = True
        if host.covered:
            print(
                f"miles: host {host.address} lost: {why}; its engines are re-placed on live hosts "
                "(--use-fault-tolerance)",
                flush=True,
            )
            return
        if _LOST is None:
            _LOST = HostLost(host.address, why, host.held)
            print(f"miles: {_LOST.line}; ending the job", flush=True)
            if self._main is not None and not self._stop.is_set():
                with contextlib.suppress(Exception):
                    signal.pthread_kill(self._main, _SIGNAL)
                if FORCE_EXIT:
                    _arm_exit(self.grace, self.final_line)


def hosts_of(placement: Any, manager_node: tuple[str, str] | None, fault_tolerant: bool) -> dict[str, Any]:
    """Node id -> (address, what runs there, covered) for every Ray node the job's placement and manager use."""
    import ray

    addresses = {n["NodeID"]: str(n.get("NodeManagerAddress")) for n in ray.nodes()}
    held: dict[str, list[str]] = {}
    roles: dict[str, set[str]] = {}
    for slot in placement.plan.slots:
        node_id = placement.node_id(slot)
        held.setdefault(node_id, []).append(slot.label)
        roles.setdefault(node_id, set()).add(slot.role)
    if manager_node is not None:
        held.setdefault(manager_node[0], []).append("the rollout manager")
        roles.setdefault(manager_node[0], set()).add("rollout_manager")
    return {
        node_id: (addresses.get(node_id, node_id), labels, fault_tolerant and roles[node_id] == {"engine"})
        for node_id, labels in held.items()
    }
