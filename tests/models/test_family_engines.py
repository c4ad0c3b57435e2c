"""flux, flux2 (klein), z_image and qwen_image through the in-process engine, against diffusers' own pipelines.

For each family: with noise level 0 the engine's loop (the family's schedule, guidance, packing inside
`forward_velocity`) reproduces `FluxPipeline` / `QwenImagePipeline` to 1e-5, and recomputing a recorded
SDE transition the way the trainer does (`guided_velocity` on collated conditions) gives back the
rollout's log-prob to 1e-6.
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
# (family fixture, engine flags, pipeline kwargs): flux with embedded guidance alone and with true CFG on top
CASES = {
    "flux": ("tiny_flux_dir", {"diffusion_guidance_scale": 3.5}, {"guidance_scale": 3.5}),
    "flux-true-cfg": (
        "tiny_flux_dir",
        {"diffusion_guidance_scale": 3.5, "diffusion_true_cfg_scale": 2.0},
        {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": " "},
    ),
    # klein base: CFG as two forwards with the empty prompt as the negative (the pipeline's, always)
    "flux2": ("tiny_flux2_klein_dir", {"diffusion_guidance_scale": 4.0}, {"guidance_scale": 4.0}),
    # Z-Image: CFG for any scale > 0, pos + s (pos - neg), the empty prompt as the negative
    "z_image": ("tiny_z_image_dir", {"diffusion_guidance_scale": 4.0}, {"guidance_scale": 4.0}),
    "qwen_image": (
        "tiny_qwen_image_dir",
        {"diffusion_true_cfg_scale": 4.0},
        {"true_cfg_scale": 4.0, "negative_prompt": " "},
    ),
}


# the batching and recompute tests run the shared engine code; the families added last run them in `extended` only
# (their noise-0 and schedule checks are in the default suite, their recompute through the trainer too)
LATER = ("flux2", "z_image")
BATCHING_CASES = [pytest.param(n, marks=pytest.mark.extended) if n in LATER else n for n in sorted(CASES)]


def _pipeline_latents(name: str, pipe, latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's `output_type="latent"` result in the engine's layout: FLUX.1 / Qwen-Image return the packed
    tokens of an 8x8 latent; klein returns the VAE latent, which the engine holds patchified and normalised."""
    if name == "flux2":
        from miles.models.flux2.config import bn_stats, patchify

        x = patchify(latents.float())
        mean, std = bn_stats(pipe.vae, x)
        return (x - mean) / std
    if name == "z_image":  # its latents are natural [B, C, h, w]
        return latents.float()
    from miles.models.flux.config import unpack_latents

    return unpack_latents(latents.float(), 8, 8)


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


_ENGINES: dict[str, DiffusersEngine] = {}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, DiffusersEngine, dict]:
    fixture, flags, pipe_kwargs = CASES[request.param]
    if request.param not in _ENGINES:
        _ENGINES[request.param] = DiffusersEngine(_args(request.getfixturevalue(fixture), **flags), device="cpu")
    return request.param, _ENGINES[request.param], pipe_kwargs


def _request(engine: DiffusersEngine, noise_level: float, sde_steps: list[list[int]], seeds, steps: int = 6):
    args = engine.args
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 3},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=steps,
        guidance_scale=float(args.diffusion_guidance_scale),
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        # klein's and Z-Image's pipelines negate "" (klein always)
        negative_prompt=None if engine.family.name in ("flux2", "z_image") else " ",
        true_cfg_scale=args.diffusion_true_cfg_scale,
    )


def test_noise_level_zero_reproduces_the_pipeline(case) -> None:
    name, engine, pipe_kwargs = case
    seeds = [5, 6]
    samples = engine.generate([_request(engine, 0.0, [[], []], seeds)])
    ours = torch.stack([s.trajectory.latents[-1] for s in samples])
    pipe = engine.pipe
    common = dict(
        prompt=PROMPT,
        num_inference_steps=6,
        height=64,
        width=64,
        num_images_per_prompt=2,
        max_sequence_length=engine.max_sequence_length,
        **pipe_kwargs,
    )
    packed = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent").images
    ref = _pipeline_latents(name, pipe, packed)
    assert ours.shape == ref.shape == (2, *engine.family.latent_shape(pipe, 64, 64))
    assert (ours - ref).abs().max().item() <= 1e-5, name
    images = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt").images
    got = torch.stack([s.image for s in samples])
    assert (got - images.float()).abs().max().item() <= 1e-5, name
    # the conditions the trainer will see: CFG scale stored only when a negative branch ran
    cond = samples[0].conditions
    assert (cond.negative is not None) == (cond.guidance_scale > 1.0)


# the families added last: their engine's log-probs against the trainer's recompute are the default suite's
# tests/training/test_family_trainer.py::test_frozen_recompute_equals_the_engine
@pytest.mark.parametrize("case", BATCHING_CASES, indirect=True)
def test_recorded_log_probs_are_reproduced_by_a_recompute(case) -> None:
    name, engine, _ = case
    sde_steps = [[0, 1, 2], [2, 3], [4]]
    samples = engine.generate([_request(engine, 0.7, sde_steps, seeds=(11, 12, 13))])
    family, pipe = engine.family, engine.pipe
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.sde_step_indices == steps and traj.log_probs.shape == (len(steps),)
        cfg = sample.conditions.guidance_scale
        pos = stack_conditions([sample], negative=False, family=family)
        neg = stack_conditions([sample], negative=True, family=family) if cfg > 1 else None
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(pipe.transformer, x, traj.timesteps[i].expand(1), pos, neg, cfg)
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
            assert abs(res.log_prob.item() - traj.log_probs[j].item()) <= 1e-6, name


def test_schedule_is_the_pipelines(case) -> None:
    """The dynamic-shift schedule (mu from the 16 image tokens) is what the pipeline set on its scheduler."""
    _, engine, pipe_kwargs = case
    pipe = engine.pipe
    sigmas, timesteps = engine._schedule(6, engine.family.latent_shape(pipe, 64, 64))
    seen: dict[str, torch.Tensor] = {}

    def grab(p, i, t, kw):
        seen.setdefault("timesteps", p.scheduler.timesteps.clone())
        seen.setdefault("sigmas", p.scheduler.sigmas.clone())
        return kw

    pipe(
        prompt=PROMPT,
        num_inference_steps=6,
        height=64,
        width=64,
        max_sequence_length=engine.max_sequence_length,
        output_type="latent",
        callback_on_step_end=grab,
        **pipe_kwargs,
    )
    assert torch.equal(timesteps, seen["timesteps"].float()) and torch.equal(sigmas, seen["sigmas"].float())
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and sigmas[-2] > 0.0


def test_flow_shift_replaces_the_dynamic_shift(tiny_flux_dir: Path) -> None:
    from miles.models.families import get_family
    from miles.sampling.sde import sd3_sigmas

    family = get_family("flux")
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_flux_dir, subfolder="scheduler")
    dynamic, _ = family.schedule(scheduler, 10, (4, 8, 8))
    shifted, _ = family.schedule(scheduler, 10, (4, 8, 8), flow_shift=3.0)
    assert scheduler.config.use_dynamic_shifting  # the live scheduler is untouched
    assert not torch.allclose(dynamic, shifted)
    # static shift 3 over linspace(1, 1/n, n): SD3's formula on FLUX's sigma grid
    grid = torch.linspace(1.0, 0.1, 10, dtype=torch.float64)
    expected = (3.0 * grid / (1 + 2.0 * grid)).float()
    assert torch.allclose(shifted[:-1], expected, atol=1e-6)
    assert sd3_sigmas(10, 3.0).shape == shifted.shape


def test_qwen_text_of_different_lengths_is_padded_and_masked(tiny_qwen_image_dir: Path) -> None:
    """Rows of different text lengths, collated (zero-padded, mask 0), give each row's own unpadded output."""
    engine = _ENGINES.get("qwen_image") or DiffusersEngine(
        _args(tiny_qwen_image_dir, diffusion_true_cfg_scale=4.0), device="cpu"
    )
    family, pipe = engine.family, engine.pipe
    rows = []
    for prompt in ("a handwritten digit 3", "white strokes on a black background"):
        pos, _ = family.encode_prompts(pipe, [prompt], None, False, engine.max_sequence_length)
        rows.append({k: v[0].float() for k, v in pos.items()})
    lengths = [int(r["encoder_hidden_states"].shape[0]) for r in rows]
    assert lengths[0] != lengths[1]
    batch = family.collate_conditions(rows)
    assert batch["encoder_hidden_states"].shape[1] == max(lengths)
    assert batch["encoder_hidden_states_mask"].sum(1).tolist() == lengths
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        together = family.forward_velocity(pipe.transformer, x, t, batch)
        for b in range(2):
            alone = family.forward_velocity(
                pipe.transformer, x[b : b + 1], t[b : b + 1], family.collate_conditions([rows[b]])
            )
            assert (together[b] - alone[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", BATCHING_CASES, indirect=True)
def test_evaluation_requests_of_different_prompts_batch_to_their_lone_outputs(case) -> None:
    """Evaluation requests (ODE) of prompts of different text lengths run as one batch when the microgroup
    size allows; each image equals the one its request makes alone."""
    from dataclasses import replace

    from miles.rollout.engines.diffusers_engine import eval_batches

    name, engine, _ = case
    prompts = ("a handwritten digit 3", "white strokes on a black background, the digit seven", "the digit 1")
    reqs = []
    for g, prompt in enumerate(prompts):
        base = _request(engine, 0.0, [[]] * (2 if g == 1 else 1), seeds=(7 + g, 20 + g)[: 2 if g == 1 else 1])
        reqs.append(replace(base, prompt=prompt, group_index=g, evaluation=True, sde_type="ode"))
    assert [len(b) for b in eval_batches(reqs, 4)] == [3]
    alone = [engine.generate([r]) for r in reqs]
    saved = engine.args.rollout_microgroup_size
    engine.args.rollout_microgroup_size = 4
    try:
        together = engine.generate(reqs)
    finally:
        engine.args.rollout_microgroup_size = saved
    flat = [s for samples in alone for s in samples]
    assert [(s.group_index, s.seed, s.prompt) for s in together] == [(s.group_index, s.seed, s.prompt) for s in flat]
    for a, b in zip(flat, together, strict=True):
        assert (a.image - b.image).abs().max().item() <= 1e-5, name
        assert a.conditions is None and b.trajectory is None


@pytest.mark.parametrize("case", BATCHING_CASES, indirect=True)
def test_training_microgroups_batch_to_their_lone_trajectories(case) -> None:
    """--rollout-engine-batch-size: training microgroups of different prompts (SDE, log-probs recorded) run as
    one forward batch; each sample's trajectory, log-probs, image and text conditions equal what its microgroup
    makes alone (to rounding: a larger matmul), and each keeps its own prompt's conditions."""
    from dataclasses import replace

    from miles.rollout.engines.diffusers_engine import eval_batches

    name, engine, _ = case
    prompts = ("a handwritten digit 3", "white strokes on a black background, the digit seven")
    reqs = [
        replace(
            _request(engine, 0.7, [[1, 2], [2, 3]], seeds=(11 + 2 * g, 12 + 2 * g)),
            prompt=prompt,
            group_index=g,
            indices=[2 * g, 2 * g + 1],
        )
        for g, prompt in enumerate(prompts)
    ]
    assert [len(b) for b in eval_batches(reqs, 1, 4)] == [2]
    alone = [s for r in reqs for s in engine.generate([r])]
    saved = getattr(engine.args, "rollout_engine_batch_size", None)
    engine.args.rollout_engine_batch_size = 4
    try:
        together = engine.generate(reqs)
    finally:
        engine.args.rollout_engine_batch_size = saved
    assert [(s.index, s.seed, s.prompt) for s in together] == [(s.index, s.seed, s.prompt) for s in alone]
    for a, b in zip(alone, together, strict=True):
        assert a.trajectory.sde_step_indices == b.trajectory.sde_step_indices
        assert (a.trajectory.latents - b.trajectory.latents).abs().max().item() <= 1e-4, name
        assert (a.trajectory.log_probs - b.trajectory.log_probs).abs().max().item() <= 1e-3, name
        for key, value in a.conditions.positive.items():  # its own prompt's, unpadded (`condition_row`)
            assert value.shape == b.conditions.positive[key].shape, (name, key)
            assert (value - b.conditions.positive[key]).abs().max().item() <= 1e-5, (name, key)
    assert not torch.equal(
        next(iter(together[0].conditions.positive.values())), next(iter(together[2].conditions.positive.values()))
    )
