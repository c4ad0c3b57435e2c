"""Who holds the device between the phases of the loop (`--offload-train`, `--offload-rollout`; both always
on under `--colocate`, where trainer ranks and engines share GPUs).

    start()        trainers sleep (everything off the device) until their first train
    generate       engines awake, trainers asleep
    to_train()     engines release their weights; trainers wake
    train
    to_sync()      trainers drop optimizer state and gradients, and under a LoRA-only sync
                   (`miles.models.lora_sync.lora_only_sync`) all of the model the sync does not read: the
                   frozen base, buffers, frozen reference (and the EMA shadow unless it is served); then
                   engines wake
    sync           what the sync reads of the trainers (all parameters, or the adapters) and the engines'
                   weights are on the devices, nothing else
    to_rollout()   trainers drop their parameters too

What moved is measured by the driver: `perf/offload_time`, `perf/onload_time` (seconds of the phase
switches in one iteration) and `perf/offload_train_bytes`, `perf/offload_rollout_bytes` (bytes the
trainers and the engines moved off their devices). With a dashboard (`miles.io.dashboard`) every move is an
`offload` or `onload` span too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

EVERYTHING = ("optimizer", "grads", "params")
# before the sync: each trainer decides what of "frozen" it may drop (`Trainer.offload`: nothing under a full sync)
BEFORE_SYNC = ("optimizer", "grads", "frozen")


class Phases:
    def __init__(self, args: Any, manager: Any, groups: Sequence[Any], dash: Any = None) -> None:
        from miles.io.dashboard import NullDashboard

        self.dash = dash or NullDashboard()
        self.train = bool(args.offload_train)
        self.rollout = bool(args.offload_rollout) and manager is not None
        self.manager = manager
        self.groups = list(groups)
        self.asleep = False  # trainers (partly) off the device
        self._reset()

    @classmethod
    def disabled(cls) -> Phases:
        """Nothing moves (a loop run without offload)."""
        from miles.io.dashboard import NullDashboard

        phases = cls.__new__(cls)
        phases.dash = NullDashboard()
        phases.train = phases.rollout = phases.asleep = False
        phases.manager, phases.groups = None, []
        phases._reset()
        return phases

    def _reset(self) -> None:
        self.metrics: dict[str, float] = {}
        if self.train or self.rollout:
            self.metrics = {"perf/offload_time": 0.0, "perf/onload_time": 0.0}
        if self.train:
            self.metrics["perf/offload_train_bytes"] = 0.0
        if self.rollout:
            self.metrics["perf/offload_rollout_bytes"] = 0.0

    def take_metrics(self) -> dict[str, float]:
        """This iteration's offload metrics (then zeroed for the next one)."""
        metrics = dict(self.metrics)
        self._reset()
        return metrics

    # ---- the switches ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.train:
            self._trainers_off(EVERYTHING)
        self._reset()

    def to_train(self) -> None:
        if self.rollout:
            self._engines("offload_engines")
        if self.train:
            self._trainers_on()

    def to_sync(self) -> None:
        if self.train:
            self._trainers_off(BEFORE_SYNC)
        if self.rollout:
            self._engines("onload_engines")

    def to_rollout(self) -> None:
        if self.train:
            self._trainers_off(("params",))

    @contextlib.contextmanager
    def trainers_awake(self) -> Iterator[None]:
        """Everything of the trainers on their devices inside the block (checkpoints, export)."""
        was_asleep = self.asleep
        if was_asleep:
            self._trainers_on()
        try:
            yield
        finally:
            if was_asleep:
                self._trainers_off(EVERYTHING)

    # ---- moves ----------------------------------------------------------------------------------
    def _trainers_off(self, parts: tuple[str, ...]) -> None:
        start = time.perf_counter()
        with self.dash.span("offload", what="trainers", parts=list(parts)) as span:
            moved = sum(group.offload(parts) for group in self.groups)
            span.args["bytes"] = moved
        self.metrics["perf/offload_time"] += time.perf_counter() - start
        self.metrics["perf/offload_train_bytes"] += moved
        self.asleep = True

    def _trainers_on(self) -> None:
        start = time.perf_counter()
        with self.dash.span("onload", what="trainers"):
            for group in self.groups:
                group.onload()
        self.metrics["perf/onload_time"] += time.perf_counter() - start
        self.asleep = False

    def _engines(self, method: str) -> None:
        import ray

        start = time.perf_counter()
        with self.dash.span(method.split("_")[0], what="engines") as span:
            moved = ray.get(getattr(self.manager, method).remote())
            span.args["bytes"] = moved
        key = "perf/offload_time" if method == "offload_engines" else "perf/onload_time"
        self.metrics[key] += time.perf_counter() - start
        if method == "offload_engines":
            self.metrics["perf/offload_rollout_bytes"] += moved
