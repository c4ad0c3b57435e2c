"""The in-process diffusers engine against the plain StableDiffusion3Pipeline and its own log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step

pytestmark = pytest.mark.slow


def _args(checkpoint: Path, **cli):
    base = {
        "hf_checkpoint": str(checkpoint),
        "prompt_data": "digits:train",
        "rm_type": "digit",
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "diffusion_num_sde_steps": 3,
        "actor_num_gpus_per_node": 1,
        "num_gpus_per_node": 1,
        "diffusion_forward_dtype": "fp32",
        "diffusion_height": 64,
        "diffusion_width": 64,
    }
    base.update(cli)
    return resolve("rl", cli=base).args


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir: Path) -> DiffusersEngine:
    return DiffusersEngine(_args(tiny_sd3_dir), device="cpu")


def _request(noise_level: float, sde_steps: list[list[int]], seeds=(11, 12, 13), steps: int = 6, **kw):
    m = len(seeds)
    return GenerateRequest(
        prompt="a handwritten digit 3",
        metadata={"label": 3},
        group_index=0,
        indices=list(range(m)),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=steps,
        guidance_scale=kw.pop("guidance_scale", 4.0),
        noise_level=noise_level,
        sde_type=kw.pop("sde_type", "sde"),
        height=64,
        width=64,
        negative_prompt=" ",
        **kw,
    )


def test_noise_level_zero_reproduces_the_plain_pipeline(engine: DiffusersEngine) -> None:
    seeds = [5, 6]
    samples = engine.generate([_request(0.0, [[], []], seeds=seeds, steps=6)])
    ours = torch.stack([s.trajectory.latents[-1] for s in samples])
    pipe = engine.pipe
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    ref = pipe(
        prompt="a handwritten digit 3",
        negative_prompt=" ",
        num_inference_steps=6,
        guidance_scale=4.0,
        height=64,
        width=64,
        num_images_per_prompt=2,
        generator=generators,
        max_sequence_length=engine.max_sequence_length,
        output_type="latent",
    ).images
    assert (ours - ref.float()).abs().max().item() <= 1e-5
    ref_images = pipe.image_processor.postprocess(
        pipe.vae.decode(ref / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor, return_dict=False)[0],
        output_type="pt",
    )
    got = torch.stack([s.image for s in samples])
    assert (got - ref_images.float()).abs().max().item() <= 1e-5


def test_recorded_log_probs_are_reproduced_by_a_recompute(engine: DiffusersEngine) -> None:
    sde_steps = [[0, 1, 2], [2, 3], [4]]
    samples = engine.generate([_request(0.7, sde_steps)])
    family, pipe = engine.family, engine.pipe
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.sde_step_indices == steps
        assert traj.log_probs.shape == (len(steps),)
        assert traj.latents.shape[0] == traj.num_steps + 1
        cond = sample.conditions
        model_cond = {k: torch.cat([cond.negative[k][None], cond.positive[k][None]]) for k in cond.positive}
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            t = traj.timesteps[i].expand(2)
            v = family.forward_velocity(pipe.transformer, torch.cat([x, x]), t, model_cond).float()
            v_neg, v_pos = v.chunk(2)
            v = family.cfg_combine(v_pos, v_neg, cond.guidance_scale)
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


def test_steps_outside_the_sde_set_are_deterministic(engine: DiffusersEngine) -> None:
    a = engine.generate([_request(0.7, [[3], [3], [3]])])
    b = engine.generate([_request(0.7, [[3], [3], [3]])])
    for sa, sb in zip(a, b, strict=True):
        assert torch.equal(sa.trajectory.latents, sb.trajectory.latents)  # reproducible per seed
        assert torch.equal(sa.trajectory.log_probs, sb.trajectory.log_probs)
    # Up to step 3 the samples follow the ODE: identical to a noise-free run of the same seeds.
    ode = engine.generate([_request(0.0, [[], [], []])])
    for s_sde, s_ode in zip(a, ode, strict=True):
        assert torch.equal(s_sde.trajectory.latents[:4], s_ode.trajectory.latents[:4])
        assert not torch.equal(s_sde.trajectory.latents[4], s_ode.trajectory.latents[4])


def test_a_sample_does_not_depend_on_its_microgroup(engine: DiffusersEngine) -> None:
    together = engine.generate([_request(0.7, [[1, 2], [1, 2], [1, 2]], seeds=(21, 22, 23))])
    alone = engine.generate([_request(0.7, [[1, 2]], seeds=(22,))])
    assert torch.allclose(together[1].trajectory.latents, alone[0].trajectory.latents, atol=1e-5)
    assert torch.allclose(together[1].trajectory.log_probs, alone[0].trajectory.log_probs, atol=1e-5)


def test_weights_update_changes_the_output(engine: DiffusersEngine) -> None:
    before = engine.transformer_state_dict()
    changed = {k: v + 0.01 for k, v in before.items() if k.endswith("proj_out.weight")}
    assert engine.update_weights(changed) == 1
    assert torch.equal(engine.transformer_state_dict()["proj_out.weight"], changed["proj_out.weight"])
    engine.update_weights({k: before[k] for k in changed})
    with pytest.raises(KeyError):
        engine.update_weights({"nope": torch.zeros(1)})
