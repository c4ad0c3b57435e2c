"""Fault tolerance of the in-process (diffusers) engine actors: real Ray, two tiny-sd3 engines.

One module-scoped manager (--use-fault-tolerance, health checks every 0.5 s) serves the tests in order:
a SIGKILLed engine mid-rollout is restarted with the synced weights and the rollout equals the undisturbed
one; a dead idle engine is found by the health checks; after an in-place sync a restarted engine copies a
live one's weights; and without fault tolerance a dead engine is one error naming it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.supervisor import DiffusersEngineError
from miles.rollout.manager import RolloutManager, build_requests

pytestmark = pytest.mark.slow

CLI: dict[str, Any] = {
    "rollout_num_engines": 2,
    "use_fault_tolerance": True,
    "rollout_health_check_interval": 0.5,
    "rollout_health_check_timeout": 20.0,
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 2,
    "rollout_microgroup_size": 2,
    "global_batch_size": 8,
    "micro_batch_size": 8,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,5",
}


@pytest.fixture(scope="module")
def manager(tiny_sd3_dir: Path, local_ray: Any):
    args = resolve("rl", recipe="tiny-digits-grpo", cli={**CLI, "hf_checkpoint": str(tiny_sd3_dir)}).args
    mgr = RolloutManager(args, use_ray_engines=True)
    yield mgr
    mgr.shutdown()


@pytest.fixture(scope="module")
def synced(manager: RolloutManager, tiny_sd3_pipeline: Any) -> dict[str, torch.Tensor]:
    """Version 1 of the weights: the checkpoint's, moved off it, so that a restart must restore them."""
    g = torch.Generator().manual_seed(0)
    state = {
        k: v.detach().clone() + 0.01 * torch.randn(v.shape, generator=g)
        for k, v in tiny_sd3_pipeline.transformer.state_dict().items()
    }
    manager.update_weights(state, 1)
    return state


def _requests(manager: RolloutManager, num_groups: int) -> list[Any]:
    groups = manager.data_source.get_samples(num_groups)
    return build_requests(manager.args, groups, manager.strategy)


def _same(a: list[Any], b: list[Any]) -> None:
    assert [s.index for s in a] == [s.index for s in b] and [s.seed for s in a] == [s.seed for s in b]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.trajectory.latents, y.trajectory.latents)
        assert torch.equal(x.trajectory.log_probs, y.trajectory.log_probs)
        assert torch.equal(x.image, y.image)


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_killed_engine_is_restarted_with_the_synced_weights_and_its_requests_resent(
    manager: RolloutManager,
    synced: dict[str, torch.Tensor],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests = _requests(manager, 8)  # 16 samples over 2 engines, sent at once (joined into forward batches)
    undisturbed = manager.run_requests(requests)
    victim = manager.engine_info()[1]["pid"]
    killed: list[int] = []
    submit = manager.supervisor._submit

    def submit_then_kill(call: Any, method: str) -> Any:  # engine 1 dies with its work in flight
        ref = submit(call, method)
        if call.engine == 1 and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        return ref

    # the rollout's own path with the kill at a point in it, not at a time: a timer at a third of the undisturbed
    # rollout's length came after engine 1's only call had finished when the machine was loaded
    monkeypatch.setattr(manager.supervisor, "_submit", submit_then_kill)
    samples = manager.run_requests(requests)
    monkeypatch.undo()
    assert killed == [victim] and len(samples) == 16
    log = manager.restart_log()
    assert [entry["engine"] for entry in log] == [1] and f"pid {victim}" in log[0]["old"]
    assert manager.engine_info()[1]["pid"] != victim
    _same(samples, undisturbed)  # same requests, same seeds, same weights: the same rollout
    restored = manager.engine_state_dict(1)
    assert all(torch.equal(restored[k], synced[k]) for k in synced)
    out = capsys.readouterr().out
    assert "restarted diffusers engine 1" in out and "weights of sync 1 re-pushed, verified (" in out


def test_a_dead_idle_engine_is_found_by_the_health_checks(manager: RolloutManager) -> None:
    import ray

    supervisor = manager.supervisor
    start = time.monotonic()
    ray.kill(manager.engines[0], no_restart=True)
    _wait_for(lambda: 0 in supervisor.failed)
    assert time.monotonic() - start < 10.0  # a 0.5 s interval
    samples = manager.run_requests(_requests(manager, 2))  # the next call restarts it first
    assert len(samples) == 4 and 0 not in supervisor.failed
    assert [entry["engine"] for entry in manager.restart_log()][-1] == 0
    assert manager.restart_log()[-1]["reason"].endswith("(found by a health check)")


def test_after_an_in_place_sync_a_restarted_engine_copies_a_live_ones_weights(
    manager: RolloutManager, synced: dict[str, torch.Tensor]
) -> None:
    import ray

    state = {k: v * 0.5 for k, v in synced.items()}  # what the trainer would pass by handle
    ray.get([engine.update_weights.remote(state, 2) for engine in manager.engines])
    manager.in_place_synced(2, {})
    ray.kill(manager.engines[1], no_restart=True)
    assert len(manager.run_requests(_requests(manager, 2))) == 4
    last = manager.restart_log()[-1]
    assert last["engine"] == 1 and "weights of in-place sync 2 copied from engine 0, verified" in last["restored"]
    restored = manager.engine_state_dict(1)
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_without_fault_tolerance_a_dead_engine_is_one_error_naming_it(manager: RolloutManager) -> None:
    manager.supervisor.fault_tolerant = False
    victim = manager.engine_info()[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(DiffusersEngineError) as excinfo:
        manager.run_requests(_requests(manager, 2))
    message = str(excinfo.value)
    assert message.startswith(f"diffusers engine 0 (pid {victim}) failed: ")
    assert message.endswith("Pass --use-fault-tolerance to restart dead engines and go on.")
    assert "\n" not in message
