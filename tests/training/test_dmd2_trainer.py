"""DMD2 on the trainer in-process (one gloo rank, tiny-sd3 as teacher and student): the critic group's
external data and step, the student's step, gradient isolation between the groups, TTUR counts, GAN head."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from miles.algorithms.dmd2 import add_noise, dm_timesteps, is_generator_step, x0_from_velocity
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.rollout.dmd2.manager import Dmd2RolloutManager
from miles.rollout.dmd2.sampler import stop_step
from miles.runtime.train_dmd2 import check_gan_data, generator_iterations
from miles.training.methods.dmd2 import critic_state, generator_inputs, model_velocity, score_samples
from miles.training.model import full_state_dict
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

SMALL = {"rollout_batch_size": 4, "global_batch_size": 4, "micro_batch_size": 4}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolved(checkpoint: Path, **cli):
    return resolve("dmd2", recipe="tiny-digits-4step", cli={**SMALL, "hf_checkpoint": str(checkpoint), **cli})


def _trainers(resolved) -> tuple[Trainer, Trainer]:
    critic = Trainer(resolved.trainer_args["critic"], master_port=_port(), total_steps=100)
    actor = Trainer(resolved.trainer_args["actor"], master_port=_port(), total_steps=100)
    return critic, actor


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in full_state_dict(module).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def job(tiny_sd3_dir: Path):
    resolved = _resolved(tiny_sd3_dir)
    manager = Dmd2RolloutManager(resolved.trainer_args["actor"])
    critic, actor = _trainers(resolved)
    return manager, critic, actor


def test_critic_equal_to_the_teacher_at_guidance_1_gives_a_zero_dm_gradient(job) -> None:
    manager, critic, actor = job  # first test: the critic has not stepped yet, so it equals the teacher
    samples = manager.generate_dmd2(0, 2).samples
    args = critic.args
    critic.args = args.with_values({"dmd2_real_guidance_scale": 1.0}, "cli")
    try:
        external = score_samples(critic, samples)
    finally:
        critic.args = args
    for row in external.values():
        assert torch.equal(row["x0_real"], row["x0_fake"])
    before = _weights(actor.model)
    metrics = actor.train(0, samples, external)
    assert metrics["dm_loss"] == 0.0 and metrics["dm_grad_abs_mean"] == 0.0 and metrics["grad_norm"] == 0.0
    after = _weights(actor.model)
    assert max((after[k] - before[k]).abs().max().item() for k in before) <= 1e-3 * 1e-4  # weight decay only


def test_external_data_is_scored_with_the_pre_update_critic_and_the_cfg_teacher(job) -> None:
    manager, critic, actor = job
    samples = manager.generate_dmd2(1, 1).samples
    args, state = critic.args, critic_state(critic)
    # the draws score_samples will make, from a copy of the critic's generator
    gen = torch.Generator().set_state(critic.generator.get_state())
    _, _, _, x0 = generator_inputs(samples)
    sigma = dm_timesteps(len(samples), args.dmd2_min_step_ratio, args.dmd2_max_step_ratio, gen)
    x_t = add_noise(x0, torch.randn(x0.shape, generator=gen), sigma)
    with torch.no_grad():
        v_fake = model_velocity(critic, critic.model, x_t, sigma * 1000, samples, 1.0)
        v_real = model_velocity(critic, state.teacher, x_t, sigma * 1000, samples, args.dmd2_real_guidance_scale)
        v_real_c = model_velocity(critic, state.teacher, x_t, sigma * 1000, samples, 1.0)
    teacher, student, start = _weights(state.teacher), _weights(actor.model), _weights(critic.model)

    metrics, external = critic.train(1, samples, True)

    assert set(external) == {s.index for s in samples}
    got_sigma = torch.stack([external[s.index]["sigma"] for s in samples])
    assert torch.equal(got_sigma, sigma) and bool(((sigma >= 0.02) & (sigma <= 0.98)).all())
    fake = torch.stack([external[s.index]["x0_fake"] for s in samples])
    real = torch.stack([external[s.index]["x0_real"] for s in samples])
    assert torch.allclose(fake, x0_from_velocity(x_t, sigma, v_fake), atol=1e-6)  # pre-update weights
    assert torch.allclose(real, x0_from_velocity(x_t, sigma, v_real), atol=1e-6)  # CFG 4
    assert not torch.allclose(real, x0_from_velocity(x_t, sigma, v_real_c), atol=1e-3)  # CFG matters here
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
    assert not _same(_weights(critic.model), start)  # the critic stepped ...
    assert _same(_weights(state.teacher), teacher)  # ... the teacher never does
    assert _same(_weights(actor.model), student)  # ... nor does the student, in the critic's step
    assert all(p.grad is None for p in critic.model.parameters())
    assert not any(p.requires_grad for p in state.teacher.parameters())


def test_student_step_recomputes_the_engine_x0_and_moves_only_the_student(job) -> None:
    manager, critic, actor = job
    samples = manager.generate_dmd2(2, 3).samples
    _, external = critic.train(2, samples, True)
    critic_weights, teacher = _weights(critic.model), _weights(critic_state(critic).teacher)
    student = _weights(actor.model)
    metrics = actor.train(2, samples, external)
    assert metrics["x0_gen_mean_abs_diff"] <= 1e-5  # the trainer's recompute matches the engine
    assert metrics["grad_norm"] > 0 and metrics["stop_timestep"] == 249.0 and metrics["dm_norm_mean"] > 0
    assert not _same(_weights(actor.model), student)
    assert _same(_weights(critic.model), critic_weights) and _same(_weights(critic_state(critic).teacher), teacher)
    assert all(p.grad is None for p in actor.model.parameters())
    weights = actor.engine_weights()
    manager.update_weights(weights, 3)
    engine = manager.engine_state_dict()
    assert max((engine[k] - weights[k]).abs().max().item() for k in weights) == 0.0
    with pytest.raises(ValueError, match="no external data"):
        actor.train(2, samples, {})


def test_ttur_ratio_5_steps_the_critic_20_times_and_the_student_at_0_5_10_15(job) -> None:
    manager, critic, actor = job
    assert generator_iterations(20, 5) == 4 and generator_iterations(7, 1) == 7
    critic_start, actor_start = critic.global_step, actor.global_step
    student_steps = []
    for it in range(20):
        samples = manager.generate_dmd2(it, stop_step(0, it, 4)).samples
        gen = is_generator_step(it, 5)
        _, external = critic.train(it, samples, gen)
        assert (external is not None) == gen
        if gen:
            actor.train(it, samples, external)
            student_steps.append(it)
    assert critic.global_step - critic_start == 20 and actor.global_step - actor_start == 4
    assert student_steps == [0, 5, 10, 15]


def _image_prompts(tmp: Path, n: int = 6) -> Path:
    rows = []
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray((rng.random((64, 64, 3)) * 255).astype(np.uint8)).save(tmp / f"{i}.png")
        rows.append({"image": f"{i}.png", "input": f"a handwritten digit {i % 10}", "metadata": {"label": i % 10}})
    path = tmp / "real.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gan_needs_prompt_data_with_images(tmp_path: Path, tiny_sd3_dir: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "a handwritten digit 1", "metadata": {"label": 1}}\n')
    args = _resolved(tiny_sd3_dir, prompt_data=str(prompts), dmd2_gan_loss_weight=0.01).args
    with pytest.raises(ConfigError, match="needs real images"):
        check_gan_data(args)
    check_gan_data(_resolved(tiny_sd3_dir, prompt_data=str(_image_prompts(tmp_path)), dmd2_gan_loss_weight=0.01).args)


def test_gan_head_steps_with_the_critic_and_its_generator_gradient_leaves_no_param_grads(
    job, tiny_sd3_dir: Path, tmp_path: Path
) -> None:
    manager = job[0]
    resolved = _resolved(tiny_sd3_dir, prompt_data=str(_image_prompts(tmp_path)), dmd2_gan_loss_weight=0.05)
    critic, actor = _trainers(resolved)
    samples = manager.generate_dmd2(0, 1).samples
    external = score_samples(critic, samples)
    state = critic_state(critic)
    assert state.head is not None and state.real is not None and state.real.latents.shape == (6, 4, 8, 8)
    row = external[samples[0].index]
    assert row["gan_grad"].shape == (4, 8, 8) and float(row["gan_grad"].abs().sum()) > 0
    assert row["gan_loss"].ndim == 0 and float(row["gan_loss"]) > 0
    # the generator-side GAN gradient flows only into the samples: no grads on the critic or the head
    assert all(p.grad is None for p in critic.model.parameters())
    assert all(p.grad is None for p in state.head.parameters())

    head = {k: v.clone() for k, v in state.head.state_dict().items()}
    metrics, external = critic.train(0, samples, True)
    assert 0.0 <= metrics["gan_d_accuracy"] <= 1.0 and metrics["gan_d_loss"] > 0 and metrics["gan_head_grad_norm"] > 0
    assert any(not torch.equal(head[k], v) for k, v in state.head.state_dict().items())
    student = _weights(actor.model)
    out = actor.train(0, samples, external)
    assert out["gan_g_loss"] > 0 and out["loss"] == pytest.approx(out["dm_loss"] + 0.05 * out["gan_g_loss"])
    assert not _same(_weights(actor.model), student)


def test_a_lora_critic_scores_with_its_base_as_the_teacher_and_keeps_training(job, tiny_sd3_dir: Path) -> None:
    manager = job[0]
    resolved = _resolved(tiny_sd3_dir, use_lora=True, lora_rank=4, lora_alpha=4)
    critic = Trainer(resolved.trainer_args["critic"], master_port=_port(), total_steps=10)
    assert critic_state(critic).teacher is None  # the LoRA base is the teacher: no second copy
    samples = manager.generate_dmd2(0, 1).samples
    lora = {n: p.detach().clone() for n, p in critic.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    first, external = critic.train(0, samples, True)
    second, _ = critic.train(1, samples, False)  # no teacher pass in between
    assert first["grad_norm"] > 0 and second["grad_norm"] > 0
    assert all(p.requires_grad for n, p in critic.model.named_parameters() if n in lora)
    assert any(not torch.equal(p.detach(), lora[n]) for n, p in critic.model.named_parameters() if n in lora)
    assert external is not None and len(external) == len(samples)
