"""cosmos3 through the in-process engine and the trainer, on the embedded tiny-cosmos3 (T2I and T2V).

Noise level 0 reproduces `Cosmos3OmniPipeline` (with the Euler scheduler the rollouts use, on UniPC's sigma
grid) to 1e-5 in latents and images; the trainer's recompute gives back the rollout's log-probs; a batched
forward equals each row's own packed forward, whatever the rows' prompt lengths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

pytestmark = pytest.mark.slow

PROMPT = "a handwritten digit 3"
SMALL = {
    "prompt_data": "digits:labels",
    "rm_type": "digit",
    "rollout_batch_size": 1,
    "n_samples_per_prompt": 4,
    "global_batch_size": 4,
    "micro_batch_size": 8,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "distributed_backend": "gloo",
    "diffusion_forward_dtype": "fp32",
    "diffusion_height": 64,
    "diffusion_width": 64,
    "diffusion_guidance_scale": 4.0,
    "lr": 1e-3,
}


def _args(checkpoint: Path, **cli):
    return resolve("rl", cli={**SMALL, "hf_checkpoint": str(checkpoint), **cli}).args


@pytest.fixture(scope="module")
def engine(tiny_cosmos3_dir: Path) -> DiffusersEngine:
    return DiffusersEngine(_args(tiny_cosmos3_dir), device="cpu")


def _request(noise_level: float, sde_steps: list[list[int]], seeds, frames: int = 1, prompt: str = PROMPT):
    return GenerateRequest(
        prompt=prompt,
        metadata={"label": 3},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=6,
        guidance_scale=4.0,
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        num_frames=frames,
        fps=8.0 if frames > 1 else None,
    )


class _EulerOnGrid:
    """`FlowMatchEulerDiscreteScheduler` at shift 1 on a given sigma grid, whatever step count it is asked for:
    what the rollouts step (the pipeline itself would step UniPC's multistep solver on that grid)."""

    def __new__(cls, sigmas: torch.Tensor):
        from diffusers import FlowMatchEulerDiscreteScheduler

        class Fixed(FlowMatchEulerDiscreteScheduler):
            def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
                super().set_timesteps(sigmas=sigmas[:-1].tolist(), device=device)

        return Fixed(num_train_timesteps=1000, shift=1.0)


@pytest.mark.parametrize("frames", [1, 9])
def test_noise_level_zero_reproduces_the_pipeline(engine: DiffusersEngine, frames: int) -> None:
    seeds = [5, 6]
    samples = engine.generate([_request(0.0, [[], []], seeds, frames)])
    traj = samples[0].trajectory
    pipe = engine.pipe
    shipped = pipe.scheduler
    assert type(shipped).__name__ == "UniPCMultistepScheduler"  # as the hub ships it; rollouts step with Euler
    shipped.set_timesteps(6)
    assert torch.equal(traj.sigmas, shipped.sigmas.float())  # UniPC's own grid
    assert torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    pipe.scheduler = _EulerOnGrid(traj.sigmas)
    try:
        for b in range(len(seeds)):
            common = dict(
                prompt=PROMPT,
                num_inference_steps=6,
                height=64,
                width=64,
                num_frames=frames,
                fps=8.0 if frames > 1 else 24.0,
                guidance_scale=4.0,
                latents=samples[b].trajectory.latents[0][None].clone(),
                enable_safety_check=False,
            )
            ref = pipe(**common, output_type="latent").video.float()
            image = pipe(**common, output_type="pt").video.float()  # [F, 3, H, W]
            ours = samples[b].trajectory.latents[-1]
            assert ours.shape == ref[0].shape == (pipe.vae.config.z_dim, frames, 8, 8)
            assert (ours - ref[0]).abs().max().item() <= 1e-5
            got = samples[b].image
            want = image[0] if frames == 1 else image.permute(1, 0, 2, 3)
            assert got.shape == want.shape
            assert (got - want).abs().max().item() <= 1e-5
    finally:
        pipe.scheduler = shipped
    # each sample's noise is its own seed's (the pipeline was handed the engine's first latents)
    assert not torch.equal(samples[0].trajectory.latents[0], samples[1].trajectory.latents[0])


def test_recorded_log_probs_are_reproduced_by_a_recompute(engine: DiffusersEngine) -> None:
    sde_steps = [[0, 2, 4], [1, 3, 5]]
    samples = engine.generate([_request(0.7, sde_steps, seeds=(11, 12))])
    family = engine.family
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        pos = stack_conditions([sample], negative=False, family=family)
        neg = stack_conditions([sample], negative=True, family=family)
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(engine.transformer, x, traj.timesteps[i].expand(1), pos, neg, 4.0)
            res = sde_step(
                v,
                x,
                traj.sigmas[i],
                traj.sigmas[i + 1],
                sde_type="sde",
                noise_level=0.7,
                sigma_max=traj.sigmas[1],
                prev_sample=traj.latents[i + 1][None],
            )
            assert abs(res.log_prob.item() - traj.log_probs[j].item()) <= 1e-6


def test_a_batch_of_prompts_of_different_lengths_is_each_rows_own_forward(engine: DiffusersEngine) -> None:
    family, pipe = engine.family, engine.pipe
    prompts = ["a handwritten digit 3", "a photo of a cat sitting on a small blurry handwriting sample"]
    geometry = {"height": 64, "width": 64, "num_frames": 1, "fps": None}
    pos, neg = family.encode_prompts(pipe, prompts, None, True, 0, geometry=geometry)
    lengths = pos["text_mask"].sum(1).tolist()
    assert lengths[0] < lengths[1] and pos["text_ids"].shape == (2, int(lengths[1]))
    # the ids are the pipeline's own tokenization (chat template + size sentence + eos + vision start)
    cond_ids, uncond_ids = pipe.tokenize_prompt(prompts[0], None, num_frames=1, height=64, width=64, fps=24.0)
    assert pos["text_ids"][0, : len(cond_ids)].long().tolist() == cond_ids
    assert neg["text_ids"][0, : len(uncond_ids)].long().tolist() == uncond_ids
    torch.manual_seed(0)
    x = torch.randn(2, *family.latent_shape(pipe, 64, 64, 1))
    t = torch.tensor([900.0, 300.0])
    both = family.guided_velocity(engine.transformer, x, t, pos, neg, 4.0)
    for row in range(2):
        # a row alone, its ids unpadded: the same velocity
        n = int(lengths[row])
        one = {"text_ids": pos["text_ids"][row : row + 1, :n], "text_mask": pos["text_mask"][row : row + 1, :n]}
        one["fps"] = pos["fps"][row : row + 1]
        m = int(neg["text_mask"][row].sum())
        one_neg = {"text_ids": neg["text_ids"][row : row + 1, :m], "text_mask": neg["text_mask"][row : row + 1, :m]}
        one_neg["fps"] = neg["fps"][row : row + 1]
        alone = family.guided_velocity(engine.transformer, x[row : row + 1], t[row : row + 1], one, one_neg, 4.0)
        assert (both[row] - alone[0]).abs().max().item() <= 1e-6
    # padded rows collate back to the batch the engine encoded
    rows = [{k: v[r, : int(lengths[r])] if k != "fps" else v[r] for k, v in pos.items()} for r in range(2)]
    collated = family.collate_conditions(rows)
    assert all(torch.equal(collated[k], pos[k]) for k in pos)
