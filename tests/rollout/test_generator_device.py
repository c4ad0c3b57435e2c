"""--diffusion-generator-device: where the in-process engine's per-sample noise generators live.

The initial latent and every SDE step's noise come from one generator per sample, seeded with the sample's
seed, on that device: with `cpu` they are exactly `torch.Generator("cpu").manual_seed(seed)`'s draws, in
order (initial noise first, then one draw per SDE step). A CUDA generator needs CUDA (skipped here without).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.sampling.seeds import draw_normal, generator_device, noise_generator

SEEDS = [21, 22]
SDE_STEP = 1


def _request() -> GenerateRequest:
    return GenerateRequest(
        prompt="a handwritten digit 7",
        metadata={"label": 7},
        group_index=0,
        indices=[0, 1],
        seeds=list(SEEDS),
        sde_steps=[[SDE_STEP], [SDE_STEP]],
        num_steps=4,
        guidance_scale=4.0,
        noise_level=0.7,
        sde_type="sde",
        height=64,
        width=64,
        negative_prompt=" ",
        debug=True,  # the engine records each step's velocity, so a step can be replayed here
    )


@pytest.mark.slow
def test_cpu_generator_noise_is_torch_cpu_generator_draws(tiny_sd3_dir: Path) -> None:
    cli = {
        "hf_checkpoint": str(tiny_sd3_dir),
        "diffusion_generator_device": "cpu",
        "diffusion_forward_dtype": "fp32",
        "diffusion_height": 64,
        "diffusion_width": 64,
    }
    args = resolve("rollout-only", recipe="tiny-digits-grpo", cli=cli).args
    engine = DiffusersEngine(args, device="cpu")
    assert engine.generator_device == torch.device("cpu")
    samples = engine.generate([_request()])
    for seed, sample in zip(SEEDS, samples, strict=True):
        traj = sample.trajectory
        reference = torch.Generator("cpu").manual_seed(seed)
        shape = tuple(traj.latents.shape[1:])
        initial = torch.randn(shape, generator=reference, dtype=torch.float32)
        assert torch.equal(traj.latents[0], initial)
        step_noise = torch.randn(shape, generator=reference, dtype=torch.float32)  # the generator's next draw
        i = SDE_STEP
        replay = sde_step(
            traj.debug_model_outputs[i][None],
            traj.latents[i][None],
            traj.sigmas[i],
            traj.sigmas[i + 1],
            sde_type="sde",
            noise_level=0.7,
            sigma_max=traj.sigmas[1],
            noise=step_noise[None],
        )
        torch.testing.assert_close(replay.prev_sample[0], traj.latents[i + 1], rtol=0, atol=1e-6)
        other = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed + 100), dtype=torch.float32)
        assert not torch.allclose(traj.latents[0], other)


def test_cpu_generator_draws_equal_a_plain_cpu_generator() -> None:
    g = noise_generator(7, generator_device("cpu", "cpu"))
    ref = torch.Generator("cpu").manual_seed(7)
    for _ in range(2):
        assert torch.equal(draw_normal((2, 3, 4), g), torch.randn((2, 3, 4), generator=ref, dtype=torch.float32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process has CUDA")
def test_a_cuda_generator_without_cuda_is_an_error_naming_the_flag() -> None:
    with pytest.raises(RuntimeError, match="--diffusion-generator-device cuda: this engine process sees no CUDA"):
        generator_device("cuda", "cpu")
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        generator_device("mps", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_generator_draws_on_the_gpu_and_returns_cpu_noise() -> None:
    device = generator_device("cuda", "cpu")
    assert device.type == "cuda"
    noise = draw_normal((4, 8), noise_generator(3, device))
    expected = torch.randn((4, 8), generator=torch.Generator("cuda").manual_seed(3), device="cuda").cpu()
    assert noise.device.type == "cpu"
    assert torch.equal(noise, expected)
    assert not torch.equal(noise, torch.randn((4, 8), generator=torch.Generator("cpu").manual_seed(3)))
