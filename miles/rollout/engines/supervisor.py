"""The in-process (diffusers) engine actors' lifecycle: start, health checks, failures and restarts.

start      one engine actor per engine slot of the placement plan (its bundle); one that fails to load
           is one error naming the engine
health     a `HealthMonitor` thread asks every engine's "health" thread for its status every
           --rollout-health-check-interval s (after --rollout-health-check-first-wait), each round
           within --rollout-health-check-timeout; an engine that does not answer is killed, so that
           whatever waits on it fails at once
requests   each engine's share goes out as one actor call per microgroup (or per batch of evaluation
           requests, as the engine itself would batch them); a call that fails because its actor died,
           or a failure the health checks found, is that engine's failure
failure    without --use-fault-tolerance: one `EngineFailure` line naming the engine (index, node and
           GPUs of its slot, pid). With it: the actor is killed for good and a new one started in the
           same slot, given the weights of the last sync (re-pushed; after an in-place sync copied from a
           live engine), verified (its weights digest and version equal what its slot reported after
           that sync), and sent the calls the dead one had not finished: the same requests with the same
           seeds, so the rollout is the one an undisturbed run makes. A restarted actor goes into its slot's
           bundle while that bundle's node is alive, else onto any alive node with the same resources
           (`relocation.py`). An engine that fails more than MAX_RESTARTS_PER_CALL times in one call, or after
           --max-engine-restarts restarts in the job, ends the job in one line
CI         with --ci-test and --use-fault-tolerance, the first rollout with id >= 2 crashes engine 0 once,
           mid-rollout (the reference's fault injection)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.core.errors import EngineFailure
from miles.models.lora_sync import is_lora_entry
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.engine_state import HEALTH_GROUP
from miles.rollout.engines.failure_text import first_line
from miles.rollout.engines.health import HealthConfig, HealthMonitor, HealthTarget

MAX_RESTARTS_PER_CALL = 3  # an engine that dies more often while serving one rollout gives up the run
DEFAULT_MAX_RESTARTS = 3  # per engine and job, when the args name none (--max-engine-restarts)
CI_CRASH_ROLLOUT = 2  # the first rollout id the CI fault injection crashes engine 0 in

RESTART_PLACE_S = 900.0  # a restarted engine must be placed and started within this (seconds)


class DiffusersEngineError(EngineFailure):
    """An in-process engine failed and the run cannot go on; the message names the engine."""


@dataclass
class _Call:
    """One actor call of a rollout: an engine's microgroup (or batch), re-sent as it was after a restart."""

    engine: int
    requests: list[GenerateRequest]
    generation: int = -1


def ray_probe(handles: Sequence[Any], timeout: float) -> list[str | None]:
    """The health probe: every engine's status on its "health" thread, all within `timeout` seconds."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    refs = [h.status.options(concurrency_group=HEALTH_GROUP).remote() for h in handles]
    deadline = time.monotonic() + timeout
    answers: list[str | None] = []
    for ref in refs:
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            answers.append(None)
        except GetTimeoutError:
            answers.append(f"no answer to a health check within {timeout:g} s (--rollout-health-check-timeout)")
        except RayActorError as exc:
            answers.append(f"its actor died: {first_line(exc)}")
        except Exception as exc:
            answers.append(f"its health check failed: {first_line(exc)}")
    return answers


def _lora_only(state: dict[str, Any]) -> bool:
    return bool(state) and all(is_lora_entry(name) for name in state)


class EngineSupervisor:
    """The engine actors (`engines`, one list shared with the manager: a restart replaces its entry) and
    everything that keeps them serving. `options(i)` are engine i's Ray options (its slot), `slot(i)`
    says where that is ("node 0, GPU 3"; "" when unknown)."""

    def __init__(
        self,
        args: Any,
        num: int,
        options: Callable[[int], dict[str, Any]],
        slot: Callable[[int], str],
        actor_class: Any = None,
        started: list[Any] | None = None,
    ) -> None:
        """`started`: the engine actors, already created (by the driver), to wait for instead of starting them."""
        if started is not None and len(started) != num:
            raise ValueError(f"{len(started)} engine actors started for {num} engines")
        if actor_class is None:
            from miles.rollout.engines.diffusers_engine import engine_actor_class

            actor_class = engine_actor_class()
        self.args = args
        self.fault_tolerant = bool(args.use_fault_tolerance)
        self._actor = actor_class
        self._options = options
        self._slot = slot
        self.lock = threading.Lock()
        self.generations = [0] * num
        self.started = [time.monotonic()] * num
        self.pids: list[int | None] = [None] * num
        self.failed: dict[int, str] = {}  # engine -> why, found by the health checks and not yet handled
        self.restarting: set[int] = set()
        self.restart_log: list[dict[str, Any]] = []
        self.restarts = [0] * num  # per engine, in this job (--max-engine-restarts)
        self.max_restarts = int(getattr(args, "max_engine_restarts", DEFAULT_MAX_RESTARTS))
        self._pushes: list[tuple[dict[str, Any], int]] = []  # what a restarted engine is given, in order
        self._in_place_version: int | None = None  # the last sync passed handles (--colocate)
        self._digests: list[dict[str, Any]] | None = None  # per engine, after the last sync (fault tolerance)
        self._crash_pending = False
        self._crash_done = False
        self.engines: list[Any] = list(started) if started is not None else [self._new_actor(i) for i in range(num)]
        for i in range(num):
            self._wait_ready(i)
            print(f"miles: {self.describe(i)} ready", flush=True)
        if self.fault_tolerant:
            self._digests = self._collect_digests()
        self.monitor = HealthMonitor(HealthConfig.from_args(args), self._targets, ray_probe, self._on_health_failure)
        self.monitor.start()

    # ---- identity --------------------------------------------------------------------------------
    def describe(self, i: int) -> str:
        where = [part for part in (self._slot(i), f"pid {self.pids[i]}" if self.pids[i] else "") if part]
        return f"diffusers engine {i}" + (f" ({', '.join(where)})" if where else "")

    def _new_actor(self, i: int, options: dict[str, Any] | None = None) -> Any:
        """Engine i's actor, in its slot unless `options` say otherwise."""
        from miles.utils.actors import tag_for

        options = self._options(i) if options is None else options
        return self._actor.options(**options).remote(self.args, _miles_tag=tag_for(self.args, "engine", i))

    def _start_again(self, i: int) -> None:
        """A new actor for engine i (a restart): in its slot's bundle while that bundle's node lives, else anywhere
        alive with the same resources; waited for like a first start."""
        from miles.rollout.engines.relocation import start_placed

        try:
            handle, status, moved = start_placed(
                self._options(i),
                lambda options: self._new_actor(i, options),
                lambda h: h.status.remote(),
                timeout=RESTART_PLACE_S,  # no live node with free resources: an error, not a wait forever
            )
        except Exception as exc:
            self.shutdown()
            raise DiffusersEngineError(f"{self.describe(i)} failed to start: {first_line(exc)}") from None
        if moved is not None:
            print(f"miles: {self.describe(i)}: {moved}", flush=True)
        with self.lock:
            self.engines[i] = handle
            self.started[i] = time.monotonic()
            self.pids[i] = int(status["pid"])

    def _wait_ready(self, i: int) -> None:
        import ray

        try:
            status = ray.get(self.engines[i].status.remote())
        except Exception as exc:
            self.shutdown()
            raise DiffusersEngineError(f"{self.describe(i)} failed to start: {first_line(exc)}") from None
        self.pids[i] = int(status["pid"])

    def shutdown(self) -> None:
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.stop()

    # ---- health checks (the monitor's thread) -----------------------------------------------------
    def _targets(self) -> list[HealthTarget]:
        with self.lock:
            return [
                HealthTarget(i, self.generations[i], handle, self.started[i])
                for i, handle in enumerate(self.engines)
                if i not in self.restarting and i not in self.failed
            ]

    def _on_health_failure(self, target: HealthTarget, reason: str) -> None:
        import ray

        with self.lock:
            if target.generation != self.generations[target.index] or target.index in self.restarting:
                return  # an actor already replaced, or being replaced
            found = reason if "health check" in reason else f"{reason} (found by a health check)"
            self.failed.setdefault(target.index, found)
        print(f"miles: {self.describe(target.index)} failed a health check: {reason}", flush=True)
        with contextlib.suppress(Exception):  # a hung engine: whatever waits on it fails now
            ray.kill(target.handle, no_restart=True)

    # ---- failures and restarts ----------------------------------------------------------------------
    def recover(self) -> None:
        """Handle the failures the health checks found since the last call (restart, or the error)."""
        with self.lock:
            found = sorted(self.failed)
        for i in found:
            self._engine_failed(i, None)

    def _engine_failed(self, i: int, why: str | None, count: int = 1) -> None:
        """Engine i failed (`why`, unless the health checks said more): the error, or its restart."""
        with self.lock:
            found = self.failed.pop(i, None)
        reason = found or why or "its actor died"
        who = self.describe(i)
        if not self.fault_tolerant:
            raise DiffusersEngineError(
                f"{who} failed: {reason}. Pass --use-fault-tolerance to restart dead engines and go on."
            )
        if count > MAX_RESTARTS_PER_CALL:
            raise DiffusersEngineError(f"{who} failed again after {count - 1} restarts in one call: {reason}")
        if self.restarts[i] >= self.max_restarts:
            if not self.restarts[i]:
                raise DiffusersEngineError(f"{who} failed: {reason}; --max-engine-restarts 0 allows no restart")
            raise DiffusersEngineError(
                f"{who} failed again after {self.restarts[i]} restarts in this job "
                f"(--max-engine-restarts {self.max_restarts}): {reason}"
            )
        self.restarts[i] += 1
        print(f"miles: {who} failed ({reason}); restarting it (--use-fault-tolerance)", flush=True)
        self.restart(i, reason)

    def restart(self, i: int, reason: str = "restart") -> None:
        """A new actor in engine i's slot, given the weights of the last sync and verified."""
        import ray

        start = time.perf_counter()
        old = self.describe(i)
        with self.lock:
            self.restarting.add(i)
        try:
            with contextlib.suppress(Exception):
                ray.kill(self.engines[i], no_restart=True)
            with self.lock:
                self.failed.pop(i, None)  # what the health checks said of the old actor
                self.generations[i] += 1
                self.pids[i] = None
            self._start_again(i)
            restored = self._restore(i)
        finally:
            with self.lock:
                self.restarting.discard(i)
        seconds = time.perf_counter() - start
        self.restart_log.append(
            {
                "engine": i,
                "reason": reason,
                "old": old,
                "new": self.describe(i),
                "restored": restored,
                "seconds": seconds,
            }
        )
        print(f"miles: restarted {old} as pid {self.pids[i]} in {seconds:.1f} s; {restored}", flush=True)

    def _restore(self, i: int) -> str:
        """Give the restarted engine i the weights of the last sync; what was done, for the log."""
        import ray

        source = i
        if self._pushes:
            for state, version in self._pushes:
                self._push_to(i, state, version)
            restored = f"weights of sync {self._pushes[-1][1]} re-pushed"
        elif self._in_place_version is not None:
            j = self._live_sibling(i)
            if j is None:
                raise DiffusersEngineError(
                    f"{self.describe(i)} was restarted, but no live engine holds the weights of in-place sync "
                    f"{self._in_place_version} (--colocate passes them by handle) to copy; run two or more engines "
                    "or without --colocate to restart an engine"
                )
            ray.get(self.engines[i].import_weights.remote(self.engines[j].export_weights.remote()))
            restored, source = f"weights of in-place sync {self._in_place_version} copied from engine {j}", j
        else:
            restored = "checkpoint weights (no sync yet)"
        return f"{restored}, {self._verify(i, source)}"

    def _push_to(self, i: int, state: dict[str, Any], version: int) -> None:
        import ray

        from miles.utils.buckets import chunk_state_dict

        for chunk in chunk_state_dict(state, int(self.args.update_weight_buffer_size)):
            ray.get(self.engines[i].update_weights.remote(chunk, version))

    def _live_sibling(self, i: int) -> int | None:
        others = [j for j in range(len(self.engines)) if j != i and j not in self.failed and j not in self.restarting]
        if not others:
            return None
        answers = ray_probe([self.engines[j] for j in others], float(self.args.rollout_health_check_timeout or 30.0))
        return next((j for j, why in zip(others, answers, strict=True) if why is None), None)

    def _verify(self, i: int, source: int) -> str:
        """The restarted engine's weights digest against what engine `source` reported after the last sync."""
        import ray

        got = ray.get(self.engines[i].weights_digest.remote())
        want = self._digests[source] if self._digests is not None else None
        if want is None:
            return f"weight version {got['version']} (no digest recorded to compare with)"
        if (got["sha256"], got["version"]) != (want["sha256"], want["version"]):
            raise DiffusersEngineError(
                f"{self.describe(i)} was restarted but does not hold the weights of the last sync: version "
                f"{got['version']} SHA-256 {got['sha256'][:16]}, expected version {want['version']} SHA-256 "
                f"{want['sha256'][:16]}"
            )
        return f"verified ({got['tensors']} tensors, version {got['version']}, SHA-256 {got['sha256'][:16]})"

    def _dead_engines(self) -> dict[int, str]:
        """Engines that do not answer a health probe now, and why."""
        answers = ray_probe(self.engines, float(self.args.rollout_health_check_timeout or 30.0))
        return {i: why for i, why in enumerate(answers) if why is not None}

    def _collect_digests(self) -> list[dict[str, Any]] | None:
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get([engine.weights_digest.remote() for engine in self.engines])
        except RayActorError:
            return None  # an engine died right after the sync: it is handled at the next call

    # ---- weight syncs -----------------------------------------------------------------------------------
    def sync(self, push: Callable[[dict[str, Any], int], int], state: dict[str, Any], version: int) -> int:
        """`push(state, version)` to every engine (the manager's chunked push); an engine that dies on the way
        is handled and the push repeated. Under fault tolerance the state is kept for restarts and every
        engine's digest recorded."""
        sent = self._with_recovery(lambda: push(state, version), "a weight sync")
        if self.fault_tolerant:
            # full weights replace what came before; a LoRA payload goes on the last full weights
            base = [p for p in self._pushes if not _lora_only(p[0])][-1:] if _lora_only(state) else []
            self._pushes = [*base, (state, version)]
            self._in_place_version = None
            self._digests = self._collect_digests()
        return sent

    def in_place_synced(self, version: int) -> None:
        """The trainer passed every engine the weights of `version` by handle (--colocate)."""
        if self.fault_tolerant:
            self._pushes = []
            self._in_place_version = version
            self._digests = self._collect_digests()

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every engine (offload, onload, placement info), after handling failures found."""
        import ray

        return self._with_recovery(lambda: ray.get([getattr(e, method).remote(*args) for e in self.engines]), method)

    def _with_recovery(self, fn: Callable[[], Any], doing: str) -> Any:
        """`fn()` over every engine; when an engine's actor died on the way it is handled (restarted, or the
        error raised) and `fn` runs again, up to MAX_RESTARTS_PER_CALL times."""
        from ray.exceptions import RayActorError

        self.recover()
        attempt = 0
        while True:
            try:
                return fn()
            except RayActorError:
                dead = self._dead_engines()
                if not dead:
                    raise
                attempt += 1
                for i, why in dead.items():
                    self._engine_failed(i, f"{why} (during {doing})", attempt)

    # ---- requests ---------------------------------------------------------------------------------------
    def inject_crash(self, rollout_id: int) -> None:
        """--ci-test with --use-fault-tolerance: crash engine 0 once, in the first rollout with id >= 2."""
        if self.args.ci_test and self.fault_tolerant and rollout_id >= CI_CRASH_ROLLOUT and not self._crash_done:
            self._crash_pending, self._crash_done = True, True

    def run(
        self,
        shards: list[list[GenerateRequest]],
        method: str = "generate",
        split: bool = True,
        on_result: Callable[[list[Any]], None] | None = None,
    ) -> list[Any]:
        """Engine i's share `shards[i]`, as calls of `method` (one per microgroup or batch of evaluation
        requests with `split`, else one per engine); the results in engine and request order. `on_result` gets
        each call's result as it arrives (the rollout scores it while the rest generate)."""
        import ray
        from ray.exceptions import RayActorError

        from miles.rollout.engines.diffusers_engine import eval_batches, forward_batch_sizes

        self.recover()
        sizes = forward_batch_sizes(self.args)
        calls = [
            _Call(i, unit)
            for i, shard in enumerate(shards)
            if shard
            for unit in (eval_batches(shard, *sizes) if split else [shard])
        ]
        waiting: dict[Any, int] = {}
        for k, call in enumerate(calls):
            waiting[self._submit(call, method)] = k
        results: dict[int, list[Any]] = {}
        restarts: dict[int, int] = {}
        crash, self._crash_pending = self._crash_pending, False
        while waiting:
            if crash and self._crash_now(calls, results):
                crash = False
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=1.0)
            for ref in ready:
                k = waiting.pop(ref, None)
                if k is None:
                    continue  # a call re-sent after a restart: its old result no longer counts
                call = calls[k]
                try:
                    results[k] = ray.get(ref)
                    if on_result is not None:
                        on_result(results[k])
                    continue
                except RayActorError as exc:
                    i = call.engine
                    if call.generation == self.generations[i]:  # the first news of this actor's death
                        restarts[i] = restarts.get(i, 0) + 1
                        self._engine_failed(i, f"its actor died: {first_line(exc)} (during a request)", restarts[i])
                    waiting[ref] = k  # re-sent below with the dead actor's other unfinished calls
                # every unfinished call of a replaced actor goes to its successor, in the original order
                stale = sorted(
                    (
                        (kk, r)
                        for r, kk in waiting.items()
                        if calls[kk].generation != self.generations[calls[kk].engine]
                    ),
                    key=lambda item: item[0],
                )
                for kk, r in stale:
                    del waiting[r]
                    waiting[self._submit(calls[kk], method)] = kk
        return [sample for k in range(len(calls)) for sample in results[k]]

    def _submit(self, call: _Call, method: str) -> Any:
        with self.lock:
            call.generation = self.generations[call.engine]
            handle = self.engines[call.engine]
        return getattr(handle, method).remote(call.requests)

    def _crash_now(self, calls: list[_Call], results: dict[int, list[Any]]) -> bool:
        """Crash engine 0 (CI fault injection) once one of its calls is done, or at once when it has only one:
        it dies with work in flight."""
        mine = [k for k, call in enumerate(calls) if call.engine == 0]
        if not mine or (len(mine) > 1 and not any(k in results for k in mine)):
            return False
        print(
            f"miles: CI fault injection (--ci-test --use-fault-tolerance): crashing {self.describe(0)} mid-rollout",
            flush=True,
        )
        with contextlib.suppress(Exception):
            self.engines[0].simulate_crash.options(concurrency_group=HEALTH_GROUP).remote()
        return True
