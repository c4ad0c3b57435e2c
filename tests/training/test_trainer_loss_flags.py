"""The loss and checkpoint flags of the trainer on a real tiny-sd3 trainer (one gloo rank) and the shared rollout
of tests/training/conftest.py: PPO clipping and old log-probs, the advantage clamp, DiffusionNFT's knobs, the
SFT noise-level shift, and which optimizer state a checkpoint saves and loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.algorithms.sft_loss import sample_sigmas
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.training import flow_matching
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow


def test_adv_clip_max_zero_leaves_no_gradient(tiny_sd3_dir: Path, rollout) -> None:
    """Every advantage clamped to 0: the policy loss is 0 whatever the ratio, so the step changes nothing."""
    _, batch = rollout
    trainer = Trainer(trainer_args(tiny_sd3_dir, lr=1e-3, diffusion_adv_clip_max=0.0), master_port=free_port())
    before = trainer.engine_weights()
    metrics = trainer.train(0, batch.samples)
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    after = trainer.engine_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("cli", "clipped"),
    [
        ({"diffusion_clip_range": 1e-9}, True),  # any drift of the ratio from 1 is clipped
        ({"diffusion_clip_range": 10.0}, False),
        ({"diffusion_clip_range": 1e-9, "diffusion_recompute_old_log_prob": True}, False),  # ratio exactly 1
    ],
)
def test_clip_range_clips_later_steps_unless_old_log_probs_are_recomputed(
    tiny_sd3_dir: Path, rollout, cli: dict[str, Any], clipped: bool
) -> None:
    """Two optimizer steps per rollout (--global-batch-size 4 of 8 samples) at a large lr: the second window's
    ratio to the rollout's log-probs moves off 1 and is clipped, unless the old log-probs are the recompute."""
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, lr=1e-2, global_batch_size=4, **cli)
    assert args.num_steps_per_rollout == 2
    metrics = Trainer(args, master_port=free_port()).train(0, batch.samples)
    assert (metrics["clipfrac"] > 0.0) is clipped, metrics["clipfrac"]


def nft_args(tiny_sd3_dir: Path, **cli: Any) -> Any:
    return trainer_args(tiny_sd3_dir, loss_type="nft", use_ema=True, **cli)


@pytest.fixture(scope="module")
def nft_trainer(tiny_sd3_dir: Path) -> Trainer:
    return Trainer(nft_args(tiny_sd3_dir), master_port=free_port())


def test_nft_timestep_fraction_and_shuffle_choose_the_trained_sigmas(nft_trainer: Trainer, rollout) -> None:
    samples = rollout[1].samples[:2]
    base = nft_trainer.args
    schedule = [float(s) for s in samples[0].trajectory.sigmas if s > 0]  # 4 steps
    try:
        nft_trainer.args = base.with_values({"diffusion_nft_timestep_fraction": 0.5}, "cli")
        half = nft_trainer.method.pairs(samples)
        assert len(half) == 2 * 2  # int(4 x 0.5) sigmas per sample
        assert all(p.sigma in schedule for p in half)
        nft_trainer.args = base.with_values({"no_diffusion_nft_shuffle_timesteps": True}, "cli")
        ordered = nft_trainer.method.pairs(samples)
        assert [p.sigma for p in ordered] == pytest.approx(schedule[:3] * 2)  # int(4 x 0.99): schedule order
        nft_trainer.args = base
        shuffled = [[p.sigma for p in nft_trainer.method.pairs(samples[:1])] for _ in range(8)]
        assert any(order != pytest.approx(schedule[:3]) for order in shuffled)  # a random order by default
    finally:
        nft_trainer.args = base


def test_nft_flags_reach_the_nft_loss(tiny_sd3_dir: Path, rollout) -> None:
    """Fresh trainers (same seed: same weights and noise) on the same rollout: the one optimizer step's loss,
    taken before the step, changes with --diffusion-nft-beta and --no-diffusion-nft-adaptive-weight."""
    samples = rollout[1].samples

    def loss(**cli: Any) -> float:
        return Trainer(nft_args(tiny_sd3_dir, **cli), master_port=free_port()).train(0, samples)["loss"]

    reference = loss()
    assert loss() == reference  # deterministic, so a difference below is the flag's
    assert loss(diffusion_nft_beta=0.25) != pytest.approx(reference, rel=1e-4)
    assert loss(no_diffusion_nft_adaptive_weight=True) != pytest.approx(reference, rel=1e-4)


def test_fsdp_flow_shift_shifts_the_sft_noise_levels(
    tiny_sd3_dir: Path, rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def recording(batch: int, generator: torch.Generator, shift: float | None = None, **kwargs: Any) -> torch.Tensor:
        state = generator.get_state()
        sigmas = sample_sigmas(batch, generator, shift=shift, **kwargs)
        unshifted = sample_sigmas(batch, torch.Generator().set_state(state), **kwargs)
        drawn.append((shift, sigmas, unshifted))
        return sigmas

    monkeypatch.setattr(flow_matching, "sample_sigmas", recording)
    cli = {"hf_checkpoint": str(tiny_sd3_dir), "fsdp_flow_shift": 3.0, "debug_skip_optimizer_step": True}
    trainer = Trainer(resolve("sft", recipe="tiny-digits-sft", cli=cli).args, master_port=free_port())
    samples = rollout[1].samples
    x0 = torch.stack([s.trajectory.latents[-1] for s in samples])
    trainer.train_sft(x0, samples)
    assert drawn and all(shift == 3.0 for shift, _, _ in drawn)
    for _, sigmas, unshifted in drawn:  # the same draws, moved toward noise: 3s / (1 + 2s)
        assert torch.allclose(sigmas, 3 * unshifted / (1 + 2 * unshifted)) and bool((sigmas > unshifted).any())
    drawn.clear()
    trainer.args = trainer.args.with_values({"fsdp_flow_shift": None}, "cli")
    trainer.train_sft(x0, samples)
    assert drawn and all(shift is None and torch.equal(s, u) for shift, s, u in drawn)


def test_no_save_optim_and_no_load_optim(tiny_sd3_dir: Path, rollout, tmp_path: Path) -> None:
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, lr=1e-3, save=str(tmp_path / "full"))
    trainer = Trainer(args, master_port=free_port())
    trainer.train(0, batch.samples)
    full = Path(trainer.save_checkpoint(str(tmp_path / "full"), 0, {"rollout_id": 0}))
    trainer.args = trainer.args.with_values({"no_save_optim": True}, "cli")
    lean = Path(trainer.save_checkpoint(str(tmp_path / "lean"), 0, {"rollout_id": 0}))
    assert (full / "optimizer.pt").is_file() and not (lean / "optimizer.pt").exists()
    assert (lean / "model.pt").is_file()

    restored = Trainer(args, master_port=free_port())
    with pytest.raises(
        ConfigError, match=r"--load .*lean: the checkpoint has no optimizer state; add --no-load-optim"
    ):
        restored.load_checkpoint(str(tmp_path / "lean"), None)
    skipping = Trainer(args.with_values({"no_load_optim": True}, "cli"), master_port=free_port())
    assert skipping.load_checkpoint(str(tmp_path / "lean"), None)["rollout_id"] == 0
    assert not skipping.optimizer.state  # the optimizer starts fresh
    assert restored.load_checkpoint(str(tmp_path / "full"), None)["rollout_id"] == 0
    assert restored.optimizer.state  # and a full checkpoint restores it
