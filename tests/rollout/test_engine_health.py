"""The in-process engines' health checks and weight hand-over, without Ray or a model (fast).

`HealthMonitor` (interval, timeout, first wait, one report per actor, its thread), the weights digest a
restarted engine is verified with, and the weights a restarted engine copies from a live one after an
in-place sync (LoRA base copies included).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from miles.config.resolution import schema_args
from miles.models.lora_sync import LoraMerger
from miles.rollout.engines.engine_state import RecoverableEngine, state_digest
from miles.rollout.engines.health import HealthConfig, HealthMonitor, HealthTarget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Probe:
    """Answers per handle: the handle's entry in `sick` (why it failed), else healthy; records what it probed."""

    def __init__(self, sick: dict[str, str] | None = None) -> None:
        self.sick = sick or {}
        self.calls: list[tuple[list[Any], float]] = []

    def __call__(self, handles: Sequence[Any], timeout: float) -> list[str | None]:
        self.calls.append((list(handles), timeout))
        return [self.sick.get(h) for h in handles]


def _monitor(targets: list[HealthTarget], probe: Any, clock: Clock, first_wait: float = 0.0, interval: float = 1.0):
    reports: list[tuple[int, int, str]] = []
    flags = schema_args(
        rollout_health_check_interval=interval,
        rollout_health_check_timeout=7.0,
        rollout_health_check_first_wait=first_wait,
    )
    monitor = HealthMonitor(
        HealthConfig.from_args(flags),
        lambda: list(targets),
        probe,
        lambda t, why: reports.append((t.index, t.generation, why)),
        clock=clock,
    )
    return monitor, reports


def test_a_failed_engine_is_reported_once_per_actor_and_a_restarted_one_is_checked_again() -> None:
    clock, probe = Clock(), Probe({"b": "its actor died"})
    targets = [HealthTarget(0, 0, "a", 0.0), HealthTarget(1, 0, "b", 0.0)]
    monitor, reports = _monitor(targets, probe, clock)
    assert monitor.check_once() == [(targets[1], "its actor died")]
    assert probe.calls == [(["a", "b"], 7.0)]  # every engine in one round, with the timeout
    assert monitor.check_once() == [] and probe.calls[-1][0] == ["a"]  # the dead actor is not asked again
    targets[1] = HealthTarget(1, 1, "b2", clock.now)  # restarted: a new generation in the same slot
    probe.sick = {"b2": "no answer"}
    monitor.check_once()
    assert reports == [(1, 0, "its actor died"), (1, 1, "no answer")]


def test_first_wait_is_each_engines_grace_after_it_starts() -> None:
    clock, probe = Clock(), Probe()
    targets = [HealthTarget(0, 0, "old", 90.0), HealthTarget(1, 1, "new", 98.0)]
    monitor, _ = _monitor(targets, probe, clock, first_wait=5.0)
    monitor.check_once()
    assert probe.calls[-1][0] == ["old"]  # "new" started 2 s ago: still loading
    clock.now = 103.0
    monitor.check_once()
    assert probe.calls[-1][0] == ["old", "new"]


def test_a_broken_probe_reports_nothing() -> None:
    def broken(handles: Sequence[Any], timeout: float) -> list[str | None]:
        raise RuntimeError("ray is shutting down")

    monitor, reports = _monitor([HealthTarget(0, 0, "a", 0.0)], broken, Clock())
    assert monitor.check_once() == [] and reports == []


def test_the_thread_checks_every_interval_after_the_first_wait_and_stops() -> None:
    found = threading.Event()
    probe = Probe({"a": "dead"})
    flags = schema_args(
        rollout_health_check_interval=0.05, rollout_health_check_timeout=1.0, rollout_health_check_first_wait=0.2
    )
    monitor = HealthMonitor(
        HealthConfig.from_args(flags),
        lambda: [HealthTarget(0, 0, "a", 0.0)],
        probe,
        lambda t, why: found.set(),
    )
    start = time.monotonic()
    monitor.start()
    assert found.wait(5.0)
    assert time.monotonic() - start >= 0.25  # first wait, then one interval (the router's timing)
    monitor.stop()
    rounds = monitor.rounds
    time.sleep(0.15)
    assert monitor.rounds == rounds


def test_interval_zero_turns_the_checks_off() -> None:
    config = HealthConfig.from_args(
        schema_args(
            rollout_health_check_interval=0, rollout_health_check_timeout=30.0, rollout_health_check_first_wait=0
        )
    )
    assert not config.enabled
    monitor = HealthMonitor(config, list, Probe(), lambda t, why: None)
    monitor.start()
    assert monitor._thread is None
    monitor.stop()


# ---- the weights a restarted engine is verified with and copies ----------------------------------------


def test_state_digest_sees_every_byte_name_and_dtype() -> None:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "s": torch.tensor(2.0, dtype=torch.float64)}
    digest = state_digest(state)
    assert digest == state_digest({k: v.clone() for k, v in reversed(state.items())})
    changed = dict(state, w=state["w"].clone())
    changed["w"][1, 2] = torch.nextafter(changed["w"][1, 2], torch.tensor(100.0))
    assert state_digest(changed) != digest
    assert state_digest({"v": state["w"], "s": state["s"]}) != digest
    assert state_digest(dict(state, w=state["w"].to(torch.bfloat16))) != digest


class TinyEngine(RecoverableEngine):
    """What the mixin needs of a DiffusersEngine: a transformer, its LoRA merger and the weight version."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.lora_merger = LoraMerger()
        self.weight_version = 0

    def sync_lora(self, payload: dict[str, torch.Tensor], version: int) -> None:
        self.lora_merger.apply(self.transformer, payload)
        self.weight_version = version


def _lora(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "0.lora_A": torch.randn(2, 4, generator=g),
        "0.lora_B": torch.randn(3, 2, generator=g),
        "0.lora_scaling": torch.tensor(0.5, dtype=torch.float64),
    }


def test_a_restarted_engine_copies_a_live_ones_weights_with_its_lora_base() -> None:
    live, restarted = TinyEngine(), TinyEngine()
    live.sync_lora(_lora(1), 3)  # an in-place LoRA sync the manager never saw
    assert live.weights_digest()["sha256"] != restarted.weights_digest()["sha256"]
    assert restarted.import_weights(live.export_weights()) == 4
    assert restarted.weights_digest() == live.weights_digest()
    assert restarted.status()["weight_version"] == 3
    for engine in (live, restarted):  # the next sync merges onto the base, not onto the merged weights
        engine.sync_lora(_lora(2), 4)
    assert restarted.weights_digest() == live.weights_digest()
    fresh = TinyEngine()
    fresh.sync_lora(_lora(2), 4)
    assert fresh.weights_digest() == live.weights_digest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_digest_of_half_precision_weights(dtype: torch.dtype) -> None:
    engine = TinyEngine()
    engine.transformer.to(dtype)
    digest = engine.weights_digest()
    assert digest["tensors"] == 4 and len(digest["sha256"]) == 64
