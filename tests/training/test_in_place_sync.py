"""In-place weight sync under --colocate: a real Ray cluster, a trainer rank and the diffusers engine actor,
the loop's own `run_iteration`. After every sync the engine serves the trainer's weights bit for bit, and
what went through Ray was a few KB of handles: the engine read the weights from the trainer's memory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import trainer_args

from miles.training.in_place_sync import source_engine

LORA = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lora_init_weights": "gaussian"}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _trainer_shm_files(group: Any) -> list[str]:
    """The /dev/shm files of rank 0's process (torch names them torch_<pid>_...)."""
    import ray

    pid = ray.get(group.actors[0].__ray_call__.remote(lambda _actor: os.getpid()))
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{pid}_")]


def _run_colocated(args: Any, rollouts: int = 2) -> list[dict[str, Any]]:
    """`rollouts` iterations of `train rl`'s loop; after each, what the sync did and what the engine holds."""
    import ray

    from miles.rollout.manager import manager_actor_class
    from miles.runtime.train_rl import run_iteration
    from miles.runtime.trainer_group import TrainerGroup

    manager = manager_actor_class().options(num_cpus=0).remote(args, None, True)
    group = TrainerGroup(args, "actor", total_steps=2 * rollouts)
    try:
        start = group.engine_weights()
        steps = []
        for rollout_id in range(rollouts):
            metrics, _ = run_iteration(args, manager, group, rollout_id)
            steps.append(
                {
                    "metrics": metrics,
                    "served": ray.get(manager.engine_state_dict.remote()),
                    "trainer": group.engine_weights(),
                    "pushed": group.weights_for_sync(),
                    "shm_files": _trainer_shm_files(group),
                }
            )
        return [{"start": start}, *steps]
    finally:
        group.shutdown()
        ray.kill(manager)


def _check_every_sync(runs: list[dict[str, Any]], lora_only: bool) -> None:
    start, steps = runs[0]["start"], runs[1:]
    previous = start
    for step in steps:
        served, trainer, pushed, m = step["served"], step["trainer"], step["pushed"], step["metrics"]
        assert served.keys() == trainer.keys()
        assert all(torch.equal(served[k], trainer[k]) for k in trainer), "engine != trainer after an in-place sync"
        assert any(not torch.equal(trainer[k], previous[k]) for k in trainer)  # the step moved the weights
        previous = trainer
        assert all("lora_" in k for k in pushed) == lora_only
        # by handle: every byte of the payload; through Ray: a few KB of handles
        assert m["sync/tensors"] == len(pushed) and m["sync/bytes_by_handle"] == _nbytes(pushed)
        assert m["sync/bytes_serialized"] < 8 * 1024 < m["sync/bytes_by_handle"]
        assert m["sync/engines"] == 1.0 and m["perf/sync_time"] > 0
        assert step["shm_files"] == []  # every bucket freed once the engine had loaded it


@pytest.mark.slow
def test_full_weights_reach_the_colocated_engine_by_handle(tiny_sd3_dir: Path, local_ray) -> None:
    args = trainer_args(tiny_sd3_dir, colocate=True, lr=1e-2)
    runs = _run_colocated(args)
    _check_every_sync(runs, lora_only=False)
    print(f"\nfull in-place sync: {[round(s['metrics']['perf/sync_time'] * 1e3, 1) for s in runs[1:]]} ms")


@pytest.mark.slow
def test_lora_only_weights_reach_the_colocated_engine_by_handle(tiny_sd3_dir: Path, local_ray) -> None:
    args = trainer_args(tiny_sd3_dir, **LORA, lora_ipc_weight_sync=True, colocate=True, lr=1e-2)
    runs = _run_colocated(args)
    _check_every_sync(runs, lora_only=True)
    # the engine merged the adapter into its base weights: W = W_base + scaling * B @ A, as the trainer does
    assert runs[-1]["metrics"]["sync/buckets"] == 2.0  # the fp64 scalings, then A and B (fp32)


def test_engine_i_is_fed_by_the_first_rank_of_its_devices() -> None:
    class Args:
        rollout_num_gpus_per_engine = 2

    assert [source_engine(Args, rank, 2) for rank in range(4)] == [0, None, 1, None]
    Args.rollout_num_gpus_per_engine = 1
    assert [source_engine(Args, rank, 2) for rank in range(3)] == [0, 1, None]
