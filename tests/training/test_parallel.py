"""HSDP, Ulysses sequence parallelism and CPU offload on 4 real gloo ranks: one Flow-GRPO step through
`Trainer` gives the same loss, gradients and weights as plain FSDP (and as one rank).

The 4 ranks are spawned once (start-up costs ~10 s a process here); every layout runs inside that spawn
(tests/training/parallel_helpers.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from parallel_helpers import LAYOUTS, TIMEOUT_MINUTES, WORLD, layout_args, off_policy, one_step, worker
from trainer_helpers import free_port

pytestmark = pytest.mark.slow

TOL = 1e-5


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tiny_sd3_dir: Path, rollout, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    samples = off_policy(rollout[1].samples)
    out = tmp_path_factory.mktemp("parallel")
    start = time.perf_counter()
    mp.spawn(worker, args=(free_port(), tiny_sd3_dir, samples, out), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    print(f"\n4-rank spawn, {len(LAYOUTS)} layouts: {time.perf_counter() - start:.1f} s")
    return {"ranks": ranks, "samples": samples}


@pytest.mark.parametrize("name", [n for n, (_, ref) in LAYOUTS.items() if n != ref])
def test_layout_equals_plain_fsdp(runs: dict[str, Any], name: str) -> None:
    ref_name = LAYOUTS[name][1]
    got, ref = runs["ranks"][0][name], runs["ranks"][0][ref_name]
    loss_diff = abs(got["metrics"]["loss"] - ref["metrics"]["loss"])
    norm_diff = abs(got["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"])
    grad_diff, weight_diff = max_diff(got["grads"], ref["grads"]), max_diff(got["weights"], ref["weights"])
    print(
        f"\n{name} vs {ref_name}: loss {loss_diff:.2e} grad_norm {norm_diff:.2e} grads {grad_diff:.2e} "
        f"weights {weight_diff:.2e} ({got['seconds']:.1f} s)"
    )
    assert ref["metrics"]["grad_norm"] > 0 and got["grads"]
    assert loss_diff <= TOL and norm_diff <= TOL and grad_diff <= TOL and weight_diff <= TOL
    for r in range(1, WORLD):  # every rank holds the same full model after the step
        assert max_diff(runs["ranks"][r][name]["weights"], got["weights"]) == 0.0


def test_plain_fsdp_equals_one_rank(tiny_sd3_dir: Path, runs: dict[str, Any]) -> None:
    from miles.training.trainer import Trainer

    trainer = Trainer(layout_args(tiny_sd3_dir, {}), master_port=free_port())  # world 1
    one = one_step(trainer, runs["samples"])
    ref = runs["ranks"][0]["fsdp4"]
    loss_diff = abs(one["metrics"]["loss"] - ref["metrics"]["loss"])
    grad_diff, weight_diff = max_diff(one["grads"], ref["grads"]), max_diff(one["weights"], ref["weights"])
    print(f"\n1 rank vs fsdp4: loss {loss_diff:.2e} grads {grad_diff:.2e} weights {weight_diff:.2e}")
    assert loss_diff <= TOL and grad_diff <= TOL and weight_diff <= TOL


def test_sp_ranks_share_their_dp_rank(runs: dict[str, Any]) -> None:
    dp = {name: [runs["ranks"][r][name]["dp"] for r in range(WORLD)] for name in LAYOUTS}
    assert dp["fsdp4"] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert dp["hsdp2x2"] == dp["fsdp4"]
    assert dp["sp2"] == dp["sp2_hsdp2"] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert dp["sp4"] == [(0, 1)] * 4


def test_every_process_group_gets_the_timeout(runs: dict[str, Any]) -> None:
    expected = TIMEOUT_MINUTES * 60.0
    timeouts = runs["ranks"][1]["sp2_hsdp2"]["timeouts"]
    assert set(timeouts) == {"world", "sp", "dp_replicate", "dp_shard"}
    assert all(t == expected for t in timeouts.values()), timeouts
