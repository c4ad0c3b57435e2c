"""The trainer's user hooks on a real tiny-sd3 rollout: custom loss, expand, convert, prepare, SFT, bad returns.

The hooks live in train_hooks_helpers.py beside this file, loaded by dotted path like a user's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import train_hooks_helpers
from trainer_helpers import free_port, trainer_args

from miles.config.resolve import resolve
from miles.training.custom_hooks import HookError
from miles.training.methods.flow_grpo import FlowGrpo
from miles.training.pairs import expand_flow_grpo, micro_batches
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

H = "train_hooks_helpers."
CUSTOM = {"loss_type": "custom_loss", "custom_loss_function_path": H + "flow_grpo_loss"}


def _trainer(tiny_sd3_dir: Path, **cli: Any) -> Trainer:
    return Trainer(trainer_args(tiny_sd3_dir, **cli), master_port=free_port())


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def test_custom_loss_reproducing_policy_loss_gives_the_builtin_loss_and_grads(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    lora = {"use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2, "diffusion_kl_beta": 0.1}
    trainer = _trainer(tiny_sd3_dir, **CUSTOM, **lora)
    assert trainer.args.ref_mode == "lora_base"
    metrics = trainer.train(0, batch.samples)  # one optimizer step through the hook moves the adapter
    assert metrics["grad_norm"] > 0 and metrics["clipfrac"] >= 0.0

    micro = micro_batches(expand_flow_grpo(batch.samples), trainer.args)[0]
    builtin_loss, builtin_metrics = FlowGrpo(trainer).micro(micro)
    builtin_loss.backward()
    builtin_grads = _grads(trainer)
    custom_loss, custom_metrics = trainer.method.micro(micro)
    custom_loss.backward()
    custom_grads = _grads(trainer)

    assert custom_metrics["kl_loss"] > 0  # the reference (adapter off) now differs: the KL path is live
    assert custom_loss.item() == builtin_loss.item()
    assert custom_metrics == builtin_metrics
    assert builtin_grads and custom_grads.keys() == builtin_grads.keys()
    assert all(torch.equal(custom_grads[k], builtin_grads[k]) for k in builtin_grads)


def test_expand_hook_keeping_one_step_per_sample_halves_the_pairs(
    tiny_sd3_dir: Path, rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, batch = rollout
    trainer = _trainer(tiny_sd3_dir, custom_expand_samples_to_train_pairs_path=H + "first_sde_step_only", lr=1e-3)
    steps = []
    step = trainer.step
    monkeypatch.setattr(trainer, "step", lambda pairs, micro: steps.append(pairs) or step(pairs, micro))
    metrics = trainer.train(0, batch.samples)
    assert len(expand_flow_grpo(batch.samples)) == 16  # the built-in: 8 samples x 2 SDE steps
    assert [len(pairs) for pairs in steps] == [8]
    assert all(p.slot == 0 for p in steps[0]) and metrics["grad_norm"] > 0


def test_convert_hook_decides_the_optimizer_steps(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    trainer = _trainer(tiny_sd3_dir, custom_convert_samples_to_train_data_path=H + "one_step_per_group", lr=1e-3)
    trainer.train(0, batch.samples)
    assert trainer.global_step == 2  # one step per prompt group; the built-in cut is one window of 8 samples


def test_prepare_hook_builds_the_dit_inputs_of_a_custom_loss(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    trainer = _trainer(
        tiny_sd3_dir,
        loss_type="custom_loss",
        custom_prepare_train_batch_path=H + "final_latent_inputs",
        custom_loss_function_path=H + "flow_matching_loss",
        lr=1e-3,
    )
    metrics = trainer.train(0, batch.samples)
    assert metrics["grad_norm"] > 0 and metrics["loss"] == pytest.approx(metrics["fm_mse"])
    seen = train_hooks_helpers.SEEN_KEYS[-1]
    assert {"latents", "timesteps", "target", "conditions"} <= seen  # the conditions filled from the pairs
    assert "negative_conditions" not in seen and "ref_model_output" not in seen


def test_sft_with_a_custom_loss_reproducing_sft_loss_takes_the_same_step(tiny_sd3_dir: Path, rollout) -> None:
    _, batch = rollout
    samples = batch.samples[:4]
    x0 = torch.stack([s.trajectory.latents[-1] for s in samples])

    def sft(**cli: Any) -> Trainer:
        args = resolve("sft", recipe="tiny-digits-sft", cli={"hf_checkpoint": str(tiny_sd3_dir), **cli}).args
        return Trainer(args, master_port=free_port())

    builtin = sft().train_sft(x0, samples)
    custom = sft(loss_type="custom_loss", custom_loss_function_path=H + "sft_as_custom_loss").train_sft(x0, samples)
    assert custom["loss"] == builtin["loss"] and custom["grad_norm"] == builtin["grad_norm"]


@pytest.mark.parametrize(
    ("cli", "flag", "expected"),
    [
        (
            {"custom_expand_samples_to_train_pairs_path": H + "pairs_as_strings"},
            "--custom-expand-samples-to-train-pairs-path",
            "expected a Pair of a Sample",
        ),
        (
            {"custom_expand_samples_to_train_pairs_path": H + "unrecorded_step"},
            "--custom-expand-samples-to-train-pairs-path",
            "is not a recorded SDE transition",
        ),
        (
            {"custom_convert_samples_to_train_data_path": H + "steps_as_a_dict"},
            "--custom-convert-samples-to-train-data-path",
            "expected a list of steps",
        ),
        (
            {**CUSTOM, "custom_prepare_train_batch_path": H + "inputs_without_timesteps"},
            "--custom-prepare-train-batch-path",
            "returned 'timesteps' = NoneType None",
        ),
        (
            {**CUSTOM, "custom_loss_function_path": H + "bare_tensor_loss"},
            "--custom-loss-function-path",
            "expected a tuple (loss tensor, metrics dict)",
        ),
        (
            {**CUSTOM, "custom_loss_function_path": H + "detached_loss"},
            "--custom-loss-function-path",
            "a loss with no graph",
        ),
    ],
    ids=["expand-not-pairs", "expand-unrecorded", "convert-not-a-list", "prepare", "loss-not-a-tuple", "loss-no-grad"],
)
def test_a_bad_hook_return_is_one_error_naming_the_flag(
    tiny_sd3_dir: Path, rollout, cli: dict[str, Any], flag: str, expected: str
) -> None:
    _, batch = rollout
    trainer = _trainer(tiny_sd3_dir, **cli)
    with pytest.raises(HookError) as excinfo:
        trainer.train(0, batch.samples)
    message = str(excinfo.value)
    assert message.startswith(f"{flag} '{H}") and expected in message and "\n" not in message
