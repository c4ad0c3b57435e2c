"""Health checks of the in-process rollout engines (Ray-free: the probe is passed in).

A `HealthMonitor` thread probes every engine every `--rollout-health-check-interval` s, the first round
`--rollout-health-check-first-wait` s plus one interval after it starts (the router's timing), each round
bounded by `--rollout-health-check-timeout`. An engine (re)started less than the first wait ago is skipped:
its grace period covers loading and warm-up. A failed engine is reported once per actor (a restart makes a
new `generation` of it, checked afresh). An interval of 0 turns the checks off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("miles.rollout.health")


@dataclass(frozen=True)
class HealthTarget:
    """One engine as the monitor sees it."""

    index: int
    generation: int  # bumped by every restart: a report about an older actor is stale
    handle: Any
    started: float  # monotonic time the actor was (re)started


# probe(handles, timeout) -> per handle None (healthy) or why it failed, within `timeout` seconds in all
Probe = Callable[[Sequence[Any], float], list[str | None]]


@dataclass(frozen=True)
class HealthConfig:
    interval: float  # --rollout-health-check-interval; <= 0: no checks
    timeout: float  # --rollout-health-check-timeout
    first_wait: float = 0.0  # --rollout-health-check-first-wait

    @classmethod
    def from_args(cls, args: Any) -> HealthConfig:
        return cls(
            interval=float(args.rollout_health_check_interval),
            timeout=float(args.rollout_health_check_timeout),
            first_wait=float(args.rollout_health_check_first_wait),
        )

    @property
    def enabled(self) -> bool:
        return self.interval > 0


class HealthMonitor:
    """Probes `targets()` in rounds on its own thread and calls `on_failure(target, reason)` once per failed
    actor. `check_once` runs one round synchronously (tests, and callers that want an answer now)."""

    def __init__(
        self,
        config: HealthConfig,
        targets: Callable[[], list[HealthTarget]],
        probe: Probe,
        on_failure: Callable[[HealthTarget, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.targets = targets
        self.probe = probe
        self.on_failure = on_failure
        self.clock = clock
        self.rounds = 0
        self._reported: set[tuple[int, int]] = set()  # (index, generation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def due(self, target: HealthTarget, now: float) -> bool:
        """Checked this round: past its grace period and not reported already."""
        if (target.index, target.generation) in self._reported:
            return False
        return now - target.started >= self.config.first_wait

    def check_once(self) -> list[tuple[HealthTarget, str]]:
        """One round: probe every due target, report and return the failures."""
        now = self.clock()
        due = [t for t in self.targets() if self.due(t, now)]
        self.rounds += 1
        if not due:
            return []
        try:
            answers = self.probe([t.handle for t in due], self.config.timeout)
        except Exception as exc:  # the probe itself broke: nothing is known about the engines
            logger.warning("engine health check round failed: %s", exc)
            return []
        failures = [(t, why) for t, why in zip(due, answers, strict=True) if why is not None]
        for target, why in failures:
            self._reported.add((target.index, target.generation))
            self.on_failure(target, why)
        return failures

    # ---- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.config.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="miles-engine-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.config.timeout + 5.0)

    def _loop(self) -> None:
        if self.config.first_wait > 0 and self._stop.wait(self.config.first_wait):
            return
        while not self._stop.wait(self.config.interval):
            try:
                self.check_once()
            except Exception as exc:  # a failure handler broke: keep checking the others
                logger.warning("engine health check failed: %s", exc)
