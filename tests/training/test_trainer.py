"""The trainer in-process (one gloo rank): recompute parity, weight sync, LoRA, SFT, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.config.resolve import resolve
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

# `rollout` (the in-process manager and its rollout 0) is a session fixture of tests/training/conftest.py.


def test_recompute_reproduces_the_engine_log_probs(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    trainer = Trainer(trainer_args(tiny_sd3_dir, debug_skip_optimizer_step=True), master_port=free_port())
    before = {k: v.clone() for k, v in trainer.engine_weights().items()}
    metrics = trainer.train(0, batch.samples)
    assert metrics["log_prob_mean_abs_diff"] <= 1e-5
    assert metrics["clipfrac"] == 0.0
    after = trainer.engine_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step taken


def test_debug_mode_compares_the_model_outputs_with_the_engines(tiny_sd3_dir: Path, rollout) -> None:
    """--diffusion-debug-mode: the engine records its guided model output per step, the trainer reports how far
    its own forward is from it (0.0 with frozen weights), and a perturbed record shows up in both metrics."""
    import copy

    manager, _ = rollout
    manager.args.diffusion_debug_mode = True
    try:
        batch = manager.generate(1)
    finally:
        manager.args.diffusion_debug_mode = False
    traj = batch.samples[0].trajectory
    assert traj.debug_model_outputs is not None and traj.debug_model_outputs.shape == traj.latents[1:].shape
    trainer = Trainer(trainer_args(tiny_sd3_dir, debug_skip_optimizer_step=True), master_port=free_port())
    metrics = trainer.train(1, batch.samples)
    assert metrics["model_output_mean_abs_diff"] == 0.0 and metrics["model_output_max_abs_diff"] == 0.0
    moved = copy.deepcopy(batch.samples)
    step = moved[3].trajectory.sde_step_indices[0]
    moved[3].trajectory.debug_model_outputs[step, 0, 0, 0] += 0.5
    metrics = trainer.train(1, moved)
    assert metrics["model_output_max_abs_diff"] == pytest.approx(0.5, abs=1e-6)  # the max over all micro-batches
    assert 0.0 < metrics["model_output_mean_abs_diff"] < 0.5
    # without debug tensors nothing is reported
    assert "model_output_mean_abs_diff" not in trainer.train(0, rollout[1].samples)


def test_a_train_step_moves_weights_and_sync_makes_the_engine_equal(tiny_sd3_dir: Path, rollout) -> None:
    manager, batch = rollout
    trainer = Trainer(trainer_args(tiny_sd3_dir, lr=1e-3), master_port=free_port())
    start = trainer.engine_weights()
    metrics = trainer.train(0, batch.samples)
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-3)
    assert metrics["log_prob_abs_diff_first_step"] <= 1e-5  # before the first update: engine == trainer
    weights = trainer.engine_weights()
    assert any(not torch.equal(start[k], weights[k]) for k in start)
    manager.update_weights(weights, 1)
    engine = manager.engine_state_dict()
    assert max((engine[k] - weights[k]).abs().max().item() for k in weights) == 0.0
    manager.update_weights(start, 2)  # leave the shared engine as it was


def test_lora_trains_only_adapters_and_syncs_merged_weights(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, use_lora=True, lora_rank=4, lora_alpha=8, lr=1e-2, diffusion_kl_beta=0.1)
    assert args.ref_mode == "lora_base"
    trainer = Trainer(args, master_port=free_port())
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    base = trainer.engine_weights()
    metrics = trainer.train(0, batch.samples)
    assert metrics["kl_loss"] == pytest.approx(0.0, abs=1e-12)  # at the reference before any step
    merged = trainer.engine_weights()
    assert set(merged) == set(base) and not any("lora_" in k for k in merged)
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("weight") for k in changed)


def test_sft_steps_lower_the_flow_matching_loss(tiny_sd3_dir: Path) -> None:
    from miles.training.sft_data import encode_sft_dataset

    args = resolve("sft", recipe="tiny-digits-sft", cli={"hf_checkpoint": str(tiny_sd3_dir), "num_rollout": 30}).args
    data = encode_sft_dataset(args)
    assert data.latents.shape[1:] == (4, 8, 8) and len(data) == 1437
    trainer = Trainer(args, master_port=free_port(), total_steps=30)
    generator = torch.Generator().manual_seed(0)
    rows = list(range(64))
    losses = [trainer.train_sft(*data.batch(rows, generator))["loss"] for _ in range(30)]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tiny_sd3_dir: Path, rollout, tmp_path) -> None:
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, lr=1e-3, save=str(tmp_path / "ckpt"))
    trainer = Trainer(args, master_port=free_port())
    trainer.train(0, batch.samples)
    trainer.save_checkpoint(args.save, 0, {"rollout_id": 0})
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    expected_next = trainer.train(1, batch.samples)
    expected = trainer.engine_weights()

    restored = Trainer(args, master_port=free_port())
    extra = restored.load_checkpoint(args.save, None)
    assert extra["rollout_id"] == 0 and extra["global_step"] == 1
    again = restored.train(1, batch.samples)
    assert again["loss"] == pytest.approx(expected_next["loss"], rel=1e-6, abs=1e-12)
    weights = restored.engine_weights()
    assert max((weights[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6


def test_lora_export_loads_with_diffusers_load_lora_weights(tiny_sd3_dir: Path, rollout, tmp_path) -> None:
    from diffusers import StableDiffusion3Pipeline

    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, use_lora=True, lora_rank=4, lora_alpha=8, lr=1e-2, lora_init_weights="gaussian")
    trainer = Trainer(args, master_port=free_port())
    trainer.train(0, batch.samples)
    merged = trainer.engine_weights()
    out = trainer.export_lora(str(tmp_path / "lora"))
    assert (Path(out) / "pytorch_lora_weights.safetensors").is_file()
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    pipe.load_lora_weights(out)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # keeps the fused weights under their plain names
    fused = pipe.transformer.state_dict()
    key = "transformer_blocks.0.attn.to_q.weight"
    assert torch.allclose(fused[key].float(), merged[key].float(), atol=1e-5)


def test_nft_step_with_the_ema_reference_trains_and_serves_the_ema(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, loss_type="nft", use_ema=True, ema_rollout_policy="ema", lr=1e-3)
    assert args.ref_mode == "ema"
    trainer = Trainer(args, master_port=free_port())
    start = {k: v.clone() for k, v in full_state(trainer).items()}
    metrics = trainer.train(0, batch.samples)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    raw = full_state(trainer)
    served = trainer.engine_weights()  # the EMA weights, swapped in and back out
    key = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(raw[key], start[key])  # the raw weights moved
    assert not torch.equal(served[key], raw[key])  # the engines get the EMA copy, not the raw weights
    assert torch.equal(full_state(trainer)[key], raw[key])  # and the swap put the raw weights back


def test_nft_kl_beta_pulls_toward_the_lora_base(tiny_sd3_dir: Path, rollout) -> None:
    """Under nft, --diffusion-kl-beta adds kl_beta * mean((v_new - v_lora_base)^2): 0 while the adapter is
    still zero, positive once it has moved, and in the loss."""
    _, batch = rollout
    lora = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2, "loss_type": "nft", "use_ema": True}
    args = trainer_args(tiny_sd3_dir, diffusion_kl_beta=0.5, **lora)
    assert args.ref_mode == "ema"  # pi_old stays the EMA; the KL's reference is the LoRA base
    trainer = Trainer(args, master_port=free_port())
    first = trainer.train(0, batch.samples)
    second = trainer.train(1, batch.samples)
    assert first["kl_loss"] < 1e-8 < second["kl_loss"]  # lora_B starts at zero: base == policy at first
    assert second["loss"] == pytest.approx(second["policy_loss"] + 0.5 * second["kl_loss"], rel=1e-4, abs=1e-8)
    plain = Trainer(trainer_args(tiny_sd3_dir, **lora), master_port=free_port())
    plain.train(0, batch.samples)
    assert plain.train(1, batch.samples)["kl_loss"] == 0.0  # kl_beta 0: no reference forward, no term


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    from miles.training.model import full_state_dict

    return full_state_dict(trainer.model)
