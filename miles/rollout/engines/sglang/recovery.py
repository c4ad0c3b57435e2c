"""What the rollout does when the miles router takes an sglang engine out: an unreachable engine is not a dead one.

The router's health checks (and its proxied requests) run on the rollout manager's host, over the engine's
advertised URL. When they fail, the engine's own Ray actor, which Ray still reaches, is asked to look at its server
from its own host (`SglangEngine.local_health`: process alive, `GET /health` on its own address). Then:

    the actor does not answer     its node or process is gone: a new actor (on a live node) under
                                  --use-fault-tolerance, else the one-line failure
    the server is down or sick    its server is restarted under --use-fault-tolerance, else the one-line failure
    healthy on its host, and the  the failure was passing (a dropped connection): the engine goes back into the
    manager reaches it again      router, nothing is restarted
    healthy on its host, but the  nothing a restart can mend: the job ends with one line naming the engine, its
    manager cannot reach it       node, the URL and the manager's host (`--rollout-engine-host`, the firewall)

Restarts are capped per job: an engine restarted --max-engine-restarts times ends the job at its next failure.
The decisions are Ray-free (the `EngineSide` answers for the engines), so they are tested on loopback servers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from miles.rollout.engines.sglang.server import health_problem

logger = logging.getLogger("miles.rollout.sglang")

ACTOR_LOST = "actor-lost"
SERVER_DOWN = "server-down"
TRANSIENT = "transient"
UNREACHABLE = "unreachable"


class ActorUnanswered(RuntimeError):
    """The engine's actor did not answer through Ray (its process or node is gone, or it hangs)."""


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # ACTOR_LOST, SERVER_DOWN, TRANSIENT or UNREACHABLE
    detail: str  # in a few words, for the log and the failure line
    node_ip: str | None = None


class EngineSide(Protocol):
    """What the recovery asks of the rollout's engines (`SglangRollout` answers for its Ray actors)."""

    def engine_url(self, i: int) -> str: ...

    def describe(self, i: int) -> str: ...

    def local_health(self, i: int) -> dict[str, Any]:
        """`SglangEngine.local_health` of engine i; raises `ActorUnanswered` when its actor does not answer."""
        ...

    def restart_engine(self, i: int, reason: str, replace_actor: bool) -> None: ...

    def readd_engine(self, i: int) -> None: ...


def unreachable_line(i: int, node_ip: str, url: str, manager_ip: str) -> str:
    return (
        f"sglang engine {i} on {node_ip} is healthy on its host but {url} is unreachable from the rollout "
        f"manager's host {manager_ip}: check --rollout-engine-host and the firewall"
    )


class EngineRecovery:
    """Diagnoses an engine the router took out and acts on it; the failures that end the job are kept in
    `failed` (engine description -> one line) for the rollout to raise in its own thread."""

    def __init__(
        self,
        side: EngineSide,
        num: int,
        fault_tolerant: Callable[[], bool],
        max_restarts: int,
        timeout: float,
        manager_ip: str,
    ) -> None:
        self.side = side
        self.fault_tolerant = fault_tolerant
        self.max_restarts = int(max_restarts)
        self.timeout = float(timeout)
        self.manager_ip = manager_ip
        self.lock = threading.Lock()
        self.failed: dict[str, str] = {}
        self.restarting = 0
        self.restarts = [0] * num  # per engine, in this job
        self.readded: list[tuple[int, str]] = []  # (engine, why): passing failures, nothing restarted

    # ---- the diagnosis -------------------------------------------------------------------------------------
    def diagnose(self, i: int) -> Diagnosis:
        try:
            local = self.side.local_health(i)
        except ActorUnanswered as exc:
            return Diagnosis(ACTOR_LOST, str(exc))
        node_ip = local.get("node_ip")
        if not local.get("healthy"):
            return Diagnosis(SERVER_DOWN, str(local.get("detail") or "its server is not healthy"), node_ip)
        url = self.side.engine_url(i)
        problem = health_problem(url, self.timeout)
        if problem is None:
            return Diagnosis(TRANSIENT, f"healthy on its host and reachable at {url} again", node_ip)
        if node_ip == self.manager_ip:  # on the manager's own host nothing is in between: a busy or stuck server
            return Diagnosis(SERVER_DOWN, f"{url}: {problem} (from its own host)", node_ip)
        return Diagnosis(UNREACHABLE, f"{url}: {problem}", node_ip)

    # ---- the router's callback (its own thread) -----------------------------------------------------------
    def record(self, who: str, line: str) -> None:
        with self.lock:
            self.failed.setdefault(who, line)

    def on_removed(self, i: int, reason: str) -> None:
        who = self.side.describe(i)
        diagnosis = self.diagnose(i)
        if diagnosis.kind == TRANSIENT:
            print(f"miles: {who} was removed ({reason}) but is {diagnosis.detail}; back in the router", flush=True)
            self.readded.append((i, reason))
            self.side.readd_engine(i)
            return
        if diagnosis.kind == UNREACHABLE:
            line = unreachable_line(i, diagnosis.node_ip or "its node", self.side.engine_url(i), self.manager_ip)
            print(f"miles: {who} was removed ({reason}): {line} ({diagnosis.detail})", flush=True)
            self.record(who, line)
            return
        reason = f"{reason}; {diagnosis.detail}"
        if not self.fault_tolerant():
            print(f"miles: {who} was removed: {reason}", flush=True)
            self.record(who, f"{who} failed: {reason}. Pass --use-fault-tolerance to restart dead engines and go on.")
            return
        used = self.restarts[i]
        if used >= self.max_restarts:
            line = (
                f"{who} failed again after {used} restarts in this job (--max-engine-restarts {self.max_restarts}): "
                f"{reason}"
                if used
                else f"{who} failed: {reason}; --max-engine-restarts 0 allows no restart"
            )
            print(f"miles: {line}", flush=True)
            self.record(who, line)
            return
        self.restarts[i] = used + 1
        with self.lock:
            self.restarting += 1
        try:
            print(f"miles: {who} was removed ({reason}); restarting it (--use-fault-tolerance)", flush=True)
            self.side.restart_engine(i, reason, diagnosis.kind == ACTOR_LOST)
        except Exception as exc:
            from miles.rollout.engines.failure_text import with_cause

            cause = with_cause(exc)
            print(f"miles: restarting {who} failed: {cause}", flush=True)
            self.record(who, f"{who} failed: {reason}; restart failed: {cause}")
        finally:
            with self.lock:
                self.restarting -= 1

    # ---- the rollout's thread -----------------------------------------------------------------------------
    def pending(self) -> int:
        with self.lock:
            return self.restarting

    def first_failure(self) -> str | None:
        with self.lock:
            return next(iter(self.failed.values()), None)
