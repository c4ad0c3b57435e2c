"""GRPO-Guard end to end on tiny-sd3: the engine records its step means, the trainer's first (on-policy) step sees
no ratio bias, the weights move; a rollout made without the means is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.rollout.manager import RolloutManager
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow


def test_grpo_guard_trains_on_the_engines_means(tiny_sd3_dir: Path, rollout) -> None:
    args = trainer_args(tiny_sd3_dir, diffusion_grpo_guard=True, diffusion_clip_range=2e-6, lr=1e-3)
    batch = RolloutManager(args).generate(0)
    kept = [s for s in batch.samples if not s.remove_sample]
    assert kept and all(s.trajectory.sde_means.shape[0] == len(s.trajectory.sde_step_indices) for s in kept)

    trainer = Trainer(args, master_port=free_port())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train(0, batch.samples)
    # one optimizer step (global batch 8 of 8 samples): on-policy, the trainer's means are the engine's
    assert trainer.global_step == 1 and metrics["grad_norm"] > 0
    assert metrics["ratio_bias"] < 1e-8
    assert metrics["log_prob_abs_diff_first_step"] < 1e-4
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)

    _, plain = rollout  # the session's rollout, made without --diffusion-grpo-guard
    with pytest.raises(ValueError, match="made without --diffusion-grpo-guard"):
        trainer.train(1, plain.samples)
