"""wan2_2_i2v (Wan2.2 image-to-video, the I2V-A14B layout) through the in-process engine, against diffusers'
`WanImageToVideoPipeline`, on the embedded tiny-wan2_2-i2v (two experts, 9 frames, the first frame's mask and
latents on the experts' input channels).

With noise level 0 the engine, given a prompt row's first frame, reproduces the pipeline's latents and videos to
1e-5 with both experts running (CFG at two scales); a recorded SDE transition recomputed the trainer's way
(`guided_velocity` on the collated conditions, the first frame's among them) gives back the rollout's log-prob to
1e-6, also after the trainer's frozen denoiser is loaded from the checkpoint on its own; the trajectory holds the
generated latents only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

PROMPT = "the digit 3 moving right"
FRAMES = 9
STEPS = 6
SMALL = {
    "prompt_data": "digits-edit:train",  # rows with one condition image each (the rules' check; not read here)
    "rm_type": "digit_edit",
    "rollout_batch_size": 1,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 4,
    "global_batch_size": 4,
    "micro_batch_size": 8,
    "diffusion_num_steps": STEPS,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "distributed_backend": "gloo",
    "diffusion_forward_dtype": "fp32",
    "diffusion_height": 64,
    "diffusion_width": 64,
    "diffusion_output_num_frames": FRAMES,
    "diffusion_guidance_scale": 4.0,
    "diffusion_guidance_scale_2": 3.0,
}


@pytest.fixture(scope="module")
def tiny_wan2_2_i2v_dir(miles_session_home: Path) -> Path:
    """tiny-wan2_2-i2v with a 5-step VAE fit: the tests need its layout, not its reconstructions."""
    from miles.builtin.tiny.wan2_2_i2v import build_tiny_wan2_2_i2v
    from miles.models.tiny.metadata import current_design

    name = f"tiny-wan2_2-i2v-design{current_design('tiny-wan2_2-i2v')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_wan2_2_i2v(path, progress=False, vae_steps=5)
    return path


@pytest.fixture(scope="module")
def engine(tiny_wan2_2_i2v_dir: Path, make_engine) -> DiffusersEngine:
    return make_engine(tiny_wan2_2_i2v_dir, **SMALL)


def _request(frame: Path, noise_level: float, sde_steps, seeds) -> GenerateRequest:
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 3, "direction": "right"},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=STEPS,
        guidance_scale=4.0,
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        num_frames=FRAMES,
        guidance_scale_2=3.0,
        media=(str(frame),),
    )


def test_the_family_is_torch_free_and_resolves_from_names() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from miles.models.families import family_from_checkpoint_name as f, get_family; "
        "assert f('Wan-AI/Wan2.2-I2V-A14B-Diffusers') == f('tiny-wan2_2-i2v') == 'wan2_2_i2v'; "
        "assert f('Wan-AI/Wan2.2-T2V-A14B-Diffusers') == f('tiny-wan2_2') == 'wan2_2'; "
        "g = get_family('wan2_2_i2v'); assert g.condition_images == (1, 1) and g.experts; "
        "assert g.example_media_conditions((16, 21, 60, 104)) == {'image_condition': ((20, 21, 60, 104), None)}; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tiny_build_is_registered() -> None:
    from miles.builtin.checkpoints import TINY_BUILDERS, tiny_builder
    from miles.builtin.tiny.wan2_2_i2v import IN_CHANNELS, build_tiny_wan2_2_i2v, grid_configs

    assert TINY_BUILDERS["tiny-wan2_2-i2v"] == "miles.builtin.tiny.wan2_2_i2v:build_tiny_wan2_2_i2v"
    assert tiny_builder("tiny-wan2_2-i2v") is build_tiny_wan2_2_i2v
    assert IN_CHANNELS == 5 and grid_configs()["transformer"]["in_channels"] == 5  # 2 + 1 + 2 (A14B: 16 + 4 + 16)


def test_the_first_frame_mask_is_the_pipelines() -> None:
    """The mask at Wan2.2's temporal factor 4 (81 frames -> 21 latent frames): 1 on latent frame 0's 4 channels."""
    from miles.models.wan2_2_i2v.config import first_frame_mask

    mask = first_frame_mask(81, 4, 21, 3, 5, torch.zeros(()))
    assert mask.shape == (1, 4, 21, 3, 5)
    assert torch.equal(mask[:, :, 0], torch.ones(1, 4, 3, 5)) and not mask[:, :, 1:].any()
    assert torch.equal(first_frame_mask(9, 1, 9, 2, 2, torch.zeros(()))[0, 0, :, 0, 0], torch.eye(9)[0])


@pytest.mark.slow
def test_the_build_loads_as_an_i2v_pipeline(tiny_wan2_2_i2v_dir: Path) -> None:
    import json

    from diffusers import WanImageToVideoPipeline

    index = json.loads((tiny_wan2_2_i2v_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == 0.9
    assert index["image_encoder"] == [None, None]
    meta = json.loads((tiny_wan2_2_i2v_dir / "miles_tiny.json").read_text())
    assert meta["name"] == "tiny-wan2_2-i2v" and meta["condition"]["in_channels"] == 5
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_wan2_2_i2v_dir)
    assert pipe.transformer_2 is not None and pipe.transformer.config.in_channels == 5


@pytest.mark.slow
def test_the_engine_is_i2v(engine: DiffusersEngine) -> None:
    assert engine.family.name == "wan2_2_i2v"
    assert type(engine.pipe).__name__ == "WanImageToVideoPipeline" and engine.pipe.image_encoder is None
    z, t = engine.pipe.vae.config.z_dim, engine.pipe.vae_scale_factor_temporal
    assert engine.pipe.transformer.config.in_channels == 2 * z + t == 5
    assert engine.pipe.transformer_2.config.out_channels == z


@pytest.mark.slow
def test_noise_level_zero_reproduces_the_pipeline(engine: DiffusersEngine, digit_pngs, monkeypatch) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    # the I2V pipeline cleans prompts with ftfy unconditionally (not installed here); WanPipeline's cleaning is the
    # same without it, and is what the family encodes with
    monkeypatch.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)
    seeds = [5, 6]
    samples = engine.generate([_request(digit_pngs[0], 0.0, [[], []], seeds)])
    timesteps = samples[0].trajectory.timesteps
    # shift 12 at 6 steps, boundary 0.9: three high-noise steps, then three low-noise ones
    assert [engine.transformer.expert_for(t) for t in timesteps] == ["transformer"] * 3 + ["transformer_2"] * 3
    pipe = engine.pipe
    shipped = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shipped.config.flow_shift)
    with Image.open(digit_pngs[0]) as image:
        first = image.convert("RGB")
    try:
        common = dict(
            image=first,
            prompt=PROMPT,
            num_inference_steps=STEPS,
            height=64,
            width=64,
            # the pipeline turns F frames with F % factor != 1 into F // factor * factor + 1: at the tiny VAE's
            # temporal factor 1, 8 asks it for 9
            num_frames=FRAMES - 1 if pipe.vae_scale_factor_temporal == 1 else FRAMES,
            num_videos_per_prompt=2,
            guidance_scale=4.0,
            guidance_scale_2=3.0,
            max_sequence_length=engine.max_sequence_length,
        )
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        ref = pipe(**common, generator=generators, output_type="latent").frames.float()
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        video = pipe(**common, generator=generators, output_type="pt").frames.float()  # [B, F, 3, H, W]
    finally:
        pipe.scheduler = shipped
    ours = torch.stack([s.trajectory.latents[-1] for s in samples])
    z = pipe.vae.config.z_dim
    assert ours.shape == ref.shape == (2, z, FRAMES, 16, 16)  # the generated latents only
    latent_diff = (ours - ref).abs().max().item()
    assert latent_diff <= 1e-5
    got = torch.stack([s.image for s in samples])  # [B, 3, F, H, W]
    video_diff = (got - video.permute(0, 2, 1, 3, 4)).abs().max().item()
    assert video_diff <= 1e-5
    print(f"max |engine - WanImageToVideoPipeline|: latents {latent_diff:.3g}, video {video_diff:.3g}")
    # the first frame's condition is recorded with both branches, and the sample carries the image for rewards
    cond = samples[0].conditions
    recorded = cond.positive["image_condition"]
    assert recorded.shape == (1 + z, FRAMES, 16, 16)
    assert torch.equal(recorded[0, 0], torch.ones(16, 16)) and not recorded[0, 1:].any()  # the mask
    assert torch.equal(cond.negative["image_condition"], recorded)
    assert all(x.shape == (z, FRAMES, 16, 16) for x in samples[0].trajectory.latents)
    assert len(samples[0].sources) == 1 and samples[0].sources[0].shape == (3, 64, 64)


@pytest.mark.slow
def test_the_first_frame_changes_the_video(engine: DiffusersEngine, digit_pngs) -> None:
    a = engine.generate([_request(digit_pngs[0], 0.0, [[]], [5])])[0]
    b = engine.generate([_request(digit_pngs[1], 0.0, [[]], [5])])[0]
    assert (a.trajectory.latents[-1] - b.trajectory.latents[-1]).abs().max().item() > 1e-3


def _recompute_drift(samples, sde_steps, family, denoiser) -> float:
    """The largest |recomputed - recorded| log-prob over the samples' SDE steps, the trainer's way."""
    drift = 0.0
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.sde_step_indices == steps and traj.log_probs.shape == (len(steps),)
        cfg, cfg_2 = sample.conditions.guidance_scale, 3.0
        pos = stack_conditions([sample], negative=False, family=family)
        neg = stack_conditions([sample], negative=True, family=family)
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(denoiser, x, traj.timesteps[i].expand(1), pos, neg, cfg, cfg_2)
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
            drift = max(drift, abs(res.log_prob.item() - traj.log_probs[j].item()))
    return drift


@pytest.mark.slow
def test_recorded_log_probs_are_reproduced_by_a_recompute(engine: DiffusersEngine, digit_pngs) -> None:
    """Steps of both experts (0-2 high noise, 3-5 low), on the engine's own denoiser."""
    sde_steps = [[0, 1, 3], [3, 4], [5]]
    samples = engine.generate([_request(digit_pngs[0], 0.7, sde_steps, seeds=(11, 12, 13))])
    drift = _recompute_drift(samples, sde_steps, engine.family, engine.transformer)
    print(f"log-prob drift (engine's denoiser): {drift:.3g}")
    assert drift <= 1e-6


@pytest.mark.slow
def test_frozen_weights_log_prob_drift(engine: DiffusersEngine, digit_pngs, tiny_wan2_2_i2v_dir: Path) -> None:
    """The trainer's own denoiser, loaded from the checkpoint (`load_denoiser`, both experts, fp32) on a family of
    its own bound to the run's flags: with frozen weights its recompute of the recorded SDE steps is the rollout's."""
    from miles.training.model import family_of

    family = family_of(engine.args)
    denoiser = family.load_denoiser(tiny_wan2_2_i2v_dir, torch.float32, family.experts)
    assert family.boundary == engine.transformer.boundary_timestep == 900.0
    sde_steps = [[0, 2], [4, 5]]
    samples = engine.generate([_request(digit_pngs[1], 0.7, sde_steps, seeds=(21, 22))])
    with torch.no_grad():
        drift = _recompute_drift(samples, sde_steps, family, denoiser)
    print(f"log-prob drift (trainer's frozen denoiser): {drift:.3g}")
    assert drift <= 1e-6


@pytest.mark.slow
def test_the_memory_plan_traces_an_i2v_job(tiny_wan2_2_i2v_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """`inspect-config` of a GRPO job on the built checkpoint traces the actor's step with the example first-frame
    condition ([T + z, f, h, w] beside the latents) on fake tensors."""
    from miles_cli.main import main

    flags = {**SMALL, "hf_checkpoint": str(tiny_wan2_2_i2v_dir), "micro_batch_size": 4}
    flags.pop("diffusion_forward_dtype")
    args = ["inspect-config", "--job", "rl"]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    assert "traced actor step (8 x 2x9x16x16" in capsys.readouterr().out
