"""flux_kontext (FLUX.1 Kontext editing) through the in-process engine, against diffusers' `FluxKontextPipeline`.

On tiny-flux's weights (the Kontext DiT is FLUX.1's class): with noise level 0 the engine, given a prompt row's
source image, reproduces the pipeline's latents and images to 1e-5, with embedded guidance alone and with true CFG;
a recorded SDE transition recomputed the trainer's way (`guided_velocity` on the collated conditions, the source
tokens among them) gives back the rollout's log-prob to 1e-6; the trajectory holds the generated latents only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from miles.models.flux.config import unpack_latents
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

pytestmark = pytest.mark.slow

PROMPT = "change the digit 3 into a 5, keeping its place and style"
CASES = {
    "embedded": ({"diffusion_guidance_scale": 3.5}, {"guidance_scale": 3.5}),
    "true-cfg": (
        {"diffusion_guidance_scale": 3.5, "diffusion_true_cfg_scale": 2.0},
        {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "negative_prompt": " "},
    ),
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tiny_flux_dir: Path, make_engine) -> tuple[str, DiffusersEngine, dict]:
    flags, pipe_kwargs = CASES[request.param]
    engine = make_engine(
        tiny_flux_dir,
        diffusion_model_family="flux_kontext",
        rollout_batch_size=2,
        diffusion_num_sde_steps=3,
        **flags,
    )
    return request.param, engine, pipe_kwargs


def _request(engine: DiffusersEngine, source: Path, noise_level: float, sde_steps, seeds, steps: int = 6):
    args = engine.args
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 5},
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
        negative_prompt=" ",
        true_cfg_scale=args.diffusion_true_cfg_scale,
        media=(str(source),),
    )


def test_the_engine_is_kontexts(case) -> None:
    _, engine, _ = case
    assert engine.family.name == "flux_kontext"
    assert type(engine.pipe).__name__ == "FluxKontextPipeline"


def test_noise_level_zero_reproduces_the_pipeline(case, digit_pngs) -> None:
    name, engine, pipe_kwargs = case
    seeds = [5, 6]
    samples = engine.generate([_request(engine, digit_pngs[0], 0.0, [[], []], seeds)])
    ours = torch.stack([s.trajectory.latents[-1] for s in samples])
    pipe = engine.pipe
    with Image.open(digit_pngs[0]) as image:
        source = image.convert("RGB")
    common = dict(
        prompt=PROMPT,
        image=source,
        num_inference_steps=6,
        height=64,
        width=64,
        max_area=64 * 64,
        _auto_resize=False,
        num_images_per_prompt=2,
        max_sequence_length=engine.max_sequence_length,
        **pipe_kwargs,
    )
    packed = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="latent").images
    ref = unpack_latents(packed.float(), 8, 8)
    assert ours.shape == ref.shape == (2, engine.family.latent_channels(pipe), 8, 8)  # the generated part only
    assert (ours - ref).abs().max().item() <= 1e-5, name
    images = pipe(**common, generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt").images
    got = torch.stack([s.image for s in samples])
    assert (got - images.float()).abs().max().item() <= 1e-5, name
    # the source tokens are recorded with both branches, and the sample carries its source image for rewards
    cond = samples[0].conditions
    assert cond.positive["ref_tokens"].shape == (16, 4 * engine.family.latent_channels(pipe))
    assert cond.positive["ref_grid"].tolist() == [8.0, 8.0]
    if cond.negative is not None:
        assert torch.equal(cond.negative["ref_tokens"], cond.positive["ref_tokens"])
    assert len(samples[0].sources) == 1 and samples[0].sources[0].shape == (3, 64, 64)


def test_the_source_changes_the_edit(case, digit_pngs) -> None:
    _, engine, _ = case
    a = engine.generate([_request(engine, digit_pngs[0], 0.0, [[]], [5])])[0]
    b = engine.generate([_request(engine, digit_pngs[1], 0.0, [[]], [5])])[0]
    assert (a.trajectory.latents[-1] - b.trajectory.latents[-1]).abs().max().item() > 1e-3


def test_recorded_log_probs_are_reproduced_by_a_recompute(case, digit_pngs) -> None:
    name, engine, _ = case
    sde_steps = [[0, 1, 2], [2, 3], [4]]
    samples = engine.generate([_request(engine, digit_pngs[0], 0.7, sde_steps, seeds=(11, 12, 13))])
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


def test_a_traced_source_takes_the_outputs_grid() -> None:
    """Under the memory plan's fake tensors a recorded grid cannot be read: a source the output's size (the plan's
    example) takes the output's grid, any other is refused; a real grid is read as recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.models.flux_kontext.config import source_grid

    assert source_grid(torch.tensor([[6, 10]]), 15, (8, 8)) == (6, 10)
    with FakeTensorMode():
        fake = torch.empty(2)
    assert source_grid(fake, 16, (8, 8)) == (8, 8)
    assert source_grid(torch.empty(2, device="meta"), 16, (8, 8)) == (8, 8)
    with pytest.raises(ValueError, match="only a source the output's size is traced"):
        source_grid(fake, 12, (8, 8))


def test_the_memory_plan_traces_an_edit_job(tiny_flux_kontext_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """`inspect-config` of the edit recipe on a built checkpoint traces the actor's step (it read the fake source
    grid's values before, and failed once the checkpoint was built)."""
    from miles_cli.main import main

    args = ["inspect-config", "--job", "sft", "--recipe", "tiny-flux-kontext-edit-sft"]
    args += ["--hf-checkpoint", str(tiny_flux_kontext_dir), "--diffusion-model-family", "flux_kontext"]
    assert main(args) == 0
    assert "traced actor step (64 x 4x8x8" in capsys.readouterr().out
