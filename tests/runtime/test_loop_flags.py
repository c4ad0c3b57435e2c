"""Flags the training loops read between the phases: when to evaluate, the debug dumps, who sleeps between the
phases, the Ray environment, and the DMD2 iteration's stop step and update ratio.

Fast: the loops' own functions run with a stand-in `ray` module (get/put are the identity) and recording
stand-ins for the manager and the trainer groups.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles.config.resolve import resolve
from miles.core.sample import Sample
from miles.io.rollout_file import load_rollout
from miles.rollout.dmd2.sampler import stop_step
from miles.runtime.phases import Phases
from miles.runtime.ray_setup import init_ray
from miles.runtime.train_dmd2 import run_iteration
from miles.runtime.train_rl import eval_due, save_debug_data

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def rl_args(**cli: Any) -> Any:
    return resolve("rl", cli={**JOB, **cli}).args


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    ray = types.ModuleType("ray")
    ray.inits = []  # type: ignore[attr-defined]
    ray.get = lambda ref: ref  # type: ignore[attr-defined]
    ray.put = lambda value: value  # type: ignore[attr-defined]
    ray.is_initialized = lambda: False  # type: ignore[attr-defined]
    ray.init = lambda **kwargs: ray.inits.append(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


class Remote:
    """`obj.method.remote(*args)` records the call and returns `result(*args)`."""

    def __init__(self, calls: list, name: str, result: Any = None) -> None:
        self.calls, self.name, self.result = calls, name, result

    def remote(self, *args: Any) -> Any:
        self.calls.append((self.name, *args))
        return self.result(*args) if callable(self.result) else self.result


# ---- evaluation and the debug dumps (train rl) ---------------------------------------------------------


def test_eval_is_due_every_eval_interval_and_before_training(tmp_path: Path) -> None:
    data = ["d=test.jsonl"]
    every_3 = rl_args(eval_prompt_data=data, eval_interval=3)
    assert [r for r in range(10) if eval_due(every_3, r, 0)] == [0, 3, 6, 9]  # rollout 0: before any training
    skip = rl_args(eval_prompt_data=data, eval_interval=3, skip_eval_before_train=True)
    assert [r for r in range(10) if eval_due(skip, r, 0)] == [3, 6, 9]
    assert [r for r in range(4, 10) if eval_due(every_3, r, 4)] == [6, 9]  # a resumed run
    assert not any(eval_due(rl_args(eval_prompt_data=data), r, 0) for r in range(10))  # no --eval-interval


def test_save_debug_data_writes_the_rollout_and_the_train_data(tmp_path: Path) -> None:
    samples = [Sample(index=i, group_index=0, prompt="p", reward=float(i), advantage=i - 0.5) for i in range(2)]
    metrics = {"train/loss": 0.25, "perf/step_time": 3.0}
    rollouts, train = str(tmp_path / "r" / "{rollout_id}.pt"), str(tmp_path / "t" / "{rollout_id}.pt")
    save_debug_data(rl_args(save_debug_rollout_data=rollouts, save_debug_train_data=train), 7, samples, metrics)
    rollout_id, saved, _ = load_rollout(tmp_path / "r" / "7.pt")
    assert rollout_id == 7 and [(s.reward, s.advantage) for s in saved] == [(0.0, -0.5), (1.0, 0.5)]
    rollout_id, saved, extra = load_rollout(tmp_path / "t" / "7.pt")
    assert rollout_id == 7 and len(saved) == 2 and extra["metrics"] == {"train/loss": 0.25}  # train metrics only
    assert extra["model"]["family"] == "sd3"  # what `miles replay` checks the job's checkpoint against
    save_debug_data(rl_args(save_debug_rollout_data=rollouts), 8, samples, metrics)
    assert (tmp_path / "r" / "8.pt").is_file() and not (tmp_path / "t" / "8.pt").exists()


# ---- who sleeps between the phases (--offload-rollout) and the Ray environment ---------------------------


@pytest.mark.parametrize("offload_rollout", [True, False])
def test_offload_rollout_puts_the_engines_to_sleep_between_phases(fake_ray: Any, offload_rollout: bool) -> None:
    calls: list = []
    manager = SimpleNamespace(
        offload_engines=Remote(calls, "offload_engines", 1000), onload_engines=Remote(calls, "onload_engines", 0)
    )
    args = rl_args(offload_rollout=offload_rollout, offload_train=False)
    phases = Phases(args, manager, [])
    phases.start()
    phases.to_train()  # the engines release their memory for the trainers
    phases.to_sync()  # and take it back for the weight sync
    phases.to_rollout()
    metrics = phases.take_metrics()
    if offload_rollout:
        assert calls == [("offload_engines",), ("onload_engines",)]
        assert metrics["perf/offload_rollout_bytes"] == 1000.0
    else:
        assert calls == [] and metrics == {}


def test_train_env_vars_reach_the_ray_runtime_env(
    fake_ray: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(rl_args(train_env_vars={"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 2}, output_dir=str(tmp_path)))
    (kwargs,) = fake_ray.inits
    env = kwargs["runtime_env"]["env_vars"]
    assert env["NCCL_DEBUG"] == "INFO" and env["OMP_NUM_THREADS"] == "2"  # as strings, for every Ray worker


# ---- one DMD2 iteration: the stop step and the update ratio ---------------------------------------------


def run_dmd2(iterations: int, **cli: Any) -> tuple[list[int], list[int], list[int]]:
    """(stop step per iteration, iterations the student trained, weight versions synced)."""
    args = resolve("dmd2", recipe="tiny-digits-4step", cli=cli).args
    calls: list = []
    batch = SimpleNamespace(metrics={}, samples=["x0"])
    manager = SimpleNamespace(
        generate_dmd2=Remote(calls, "generate", batch),
        in_place_engines=Remote(calls, "in_place_engines", []),
        update_weights=Remote(calls, "update_weights"),
    )
    critic = SimpleNamespace(call=lambda method, it, samples, gen: [({"loss": 1.0}, {})])
    trained: list[int] = []
    actor = SimpleNamespace(
        call=lambda method, it, samples, external: trained.append(it) or [{"loss": 2.0}],
        weights_for_sync=lambda: {"w": 0},
    )
    for it in range(iterations):
        run_iteration(args, manager, critic, actor, it)
    stops = [call[2] for call in calls if call[0] == "generate"]
    synced = [call[2] for call in calls if call[0] == "update_weights"]
    return stops, trained, synced


def test_dmd2_iteration_follows_backward_simulation_and_the_update_ratio(fake_ray: Any) -> None:
    stops, trained, synced = run_dmd2(8, dmd2_backward_simulation=True, dmd2_critic_update_ratio=3, seed=5)
    assert stops == [stop_step(5, it, 4, True) for it in range(8)] and len(set(stops)) > 1  # k ~ U{0..3}
    assert trained == [0, 3, 6] and synced == [1, 4, 7]  # the student steps (and syncs) every 3rd iteration
    stops, trained, _ = run_dmd2(4, dmd2_backward_simulation=False, dmd2_critic_update_ratio=1)
    assert stops == [0, 0, 0, 0] and trained == [0, 1, 2, 3]  # no backward simulation: from pure noise
    stops, _, _ = run_dmd2(8, dmd2_student_timesteps="999,499", seed=5)  # a 2-step student: k ~ U{0, 1}
    assert stops == [stop_step(5, it, 2, True) for it in range(8)] and set(stops) == {0, 1}
