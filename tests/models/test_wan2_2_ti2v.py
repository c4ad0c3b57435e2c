"""wan2_2_ti2v (Wan2.2 TI2V-5B image-to-video, `expand_timesteps`) through the in-process engine, against diffusers'
`WanImageToVideoPipeline(expand_timesteps=True)`, on the embedded tiny-wan2_2-ti2v (one transformer, 9 frames, the
first frame's latents in latent frame 0 at timestep 0).

With noise level 0 the engine, given a prompt row's first frame, reproduces the pipeline's latents and videos (CFG);
every recorded latent holds the condition on frame 0; a recorded SDE transition recomputed the trainer's way (the
family's `step_mask` on the step) gives back the rollout's log-prob, also with the trainer's own denoiser; frame 0
contributes nothing to the log-prob, the KL, nor to the SFT, NFT and DPO losses; the rules refuse sglang, DMD2,
offline DPO and one-frame outputs; the real TI2V-5B's LoRA GRPO plan fits 80 GiB.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
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
}
REAL = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"


@pytest.fixture(scope="session")
def tiny_wan2_2_ti2v_dir(miles_session_home: Path) -> Path:
    """tiny-wan2_2-ti2v with a 5-step VAE fit: the tests need its layout, not its reconstructions."""
    from miles.builtin.tiny.wan2_2_ti2v import build_tiny_wan2_2_ti2v
    from miles.models.tiny.metadata import current_design

    name = f"tiny-wan2_2-ti2v-design{current_design('tiny-wan2_2-ti2v')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_wan2_2_ti2v(path, progress=False, vae_steps=5)
    return path


@pytest.fixture(scope="module")
def engine(tiny_wan2_2_ti2v_dir: Path, make_engine) -> DiffusersEngine:
    return make_engine(tiny_wan2_2_ti2v_dir, **SMALL)


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
        media=(str(frame),),
    )


# ---- torch-free: names, layout, rules ------------------------------------------------------------------------------
def test_the_family_is_torch_free_and_resolves_from_names() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from miles.models.families import family_from_checkpoint_name as f, get_family; "
        "assert f('Wan-AI/Wan2.2-TI2V-5B-Diffusers') == f('tiny-wan2_2-ti2v') == 'wan2_2_ti2v'; "
        "assert f('Wan-AI/Wan2.2-I2V-A14B-Diffusers') == f('tiny-wan2_2-i2v') == 'wan2_2_i2v'; "
        "assert f('Wan-AI/Wan2.2-T2V-A14B-Diffusers') == f('tiny-wan2_2') == 'wan2_2'; "
        "g = get_family('wan2_2_ti2v'); assert g.condition_images == (1, 1) and g.experts == (); "
        "assert g.weight_sync_targets == ('transformer',) and g.fsdp_block_lists == ('blocks',); "
        "assert g.example_media_conditions((48, 31, 44, 80)) == {'first_frame': ((48, 1, 44, 80), None)}; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_local_directory_without_a_name_hint_resolves_by_its_model_index(tmp_path: Path) -> None:
    """A TI2V checkpoint as the hub saves it (`WanPipeline` with `expand_timesteps`), or as a trainer's checkpoint
    named `checkpoint`: wan2_2_ti2v, not wan2_2 (the same pipeline class) nor wan2_2_i2v."""
    import json

    from miles.models.families import family_from_model_index

    cases = [
        ({"_class_name": "WanPipeline", "expand_timesteps": True}, "wan2_2_ti2v"),
        ({"_class_name": "WanImageToVideoPipeline", "expand_timesteps": True}, "wan2_2_ti2v"),
        ({"_class_name": "WanPipeline", "boundary_ratio": 0.875}, "wan2_2"),
        ({"_class_name": "WanImageToVideoPipeline", "expand_timesteps": False}, "wan2_2_i2v"),
    ]
    for i, (index, family) in enumerate(cases):
        folder = tmp_path / str(i) / "checkpoint"
        folder.mkdir(parents=True)
        (folder / "model_index.json").write_text(json.dumps(index))
        assert family_from_model_index(str(folder)) == family, index


def test_the_tiny_build_is_registered() -> None:
    from miles.builtin.checkpoints import TINY_BUILDERS, tiny_builder
    from miles.builtin.tiny.wan2_2_ti2v import build_tiny_wan2_2_ti2v, grid_configs

    assert TINY_BUILDERS["tiny-wan2_2-ti2v"] == "miles.builtin.tiny.wan2_2_ti2v:build_tiny_wan2_2_ti2v"
    assert tiny_builder("tiny-wan2_2-ti2v") is build_tiny_wan2_2_ti2v
    configs = grid_configs()
    assert configs["transformer"]["in_channels"] == configs["transformer"]["out_channels"] == 2  # latents only
    assert configs["model_index"]["expand_timesteps"] is True and "transformer_2" not in configs


def test_token_timesteps_are_the_pipelines_for_a_2x2_patch_and_follow_other_patches() -> None:
    """0 on latent frame 0's tokens, t elsewhere: `first_frame_mask[0][0][:, ::2, ::2] * t` for Wan's patch."""
    from miles.models.wan2_2_ti2v.config import token_timesteps

    t = torch.tensor([937.5, 120.0])
    mask = torch.ones(1, 1, 5, 6, 8)
    mask[:, :, 0] = 0
    pipeline = torch.stack([(mask[0][0][:, ::2, ::2] * s).flatten() for s in t])
    assert torch.equal(token_timesteps(t, (5, 6, 8), (1, 2, 2)), pipeline)
    wide = token_timesteps(t, (5, 16, 16), (1, 16, 16))  # one token a frame
    assert wide.shape == (2, 5) and torch.equal(wide[:, 0], torch.zeros(2)) and torch.equal(wide[:, 1], t)
    with pytest.raises(ValueError, match="temporal patch"):
        token_timesteps(t, (5, 6, 8), (2, 2, 2))


def test_the_generated_mask_leaves_out_frame_0_and_the_other_families_have_none() -> None:
    from miles.models.families import get_family, registered_families

    family = get_family("wan2_2_ti2v")
    mask = family.generated_mask((2, 9, 4, 4))
    assert mask.shape == (2, 9, 4, 4) and not mask[:, 0].any() and mask[:, 1:].all()
    assert torch.equal(family.step_mask((2, 9, 4, 4)), mask) and torch.equal(family.loss_mask((2, 9, 4, 4)), mask)
    for key in registered_families():  # every other family: unchanged (its step and loss masks are its own)
        if key == "wan2_2_ti2v":
            continue
        other = get_family(key)
        shape = (4, 3, 8, 8) if other.makes_video else (4, 8, 8)
        assert other.generated_mask(shape) is None
        if key != "ltx":
            assert other.step_mask(shape) is None and other.loss_mask(shape) is None


def _fails(job: str, **cli) -> str:
    base = {**SMALL, "hf_checkpoint": REAL}
    with pytest.raises(ConfigError) as err:
        resolve(job, cli={**base, **cli})
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_rules_refuse_sglang_dmd2_offline_dpo_one_frame_and_a_second_scale() -> None:
    import sys

    sglang = {"rollout_backend": "sglang", "sglang_python": sys.executable}
    message = _fails("rl", **sglang)
    assert "model family 'wan2_2_ti2v'" in message and "condition images" in message
    assert resolve("rl", cli={**SMALL, "hf_checkpoint": REAL}).args.rollout_backend == "diffusers"  # auto
    assert "DMD2 samples its student from text alone" in _fails("dmd2")
    assert "offline DPO" in _fails("sft", loss_type="dpo", prompt_data="digits-preference:train")
    assert "nothing to generate" in _fails("rl", diffusion_output_num_frames=1)
    assert "one transformer" in _fails("rl", diffusion_guidance_scale_2=3.0)
    assert "trains and syncs transformer" in _fails("rl", update_weight_target_module="transformer,transformer_2")


@pytest.mark.extended  # traces the real-size step on fake tensors: 27-40 s on 2 cores
def test_the_real_lora_grpo_plan_fits_80_gib(capsys: pytest.CaptureFixture) -> None:
    """`miles plan` of a LoRA Flow-GRPO job on the real TI2V-5B (its shipped configs), 33 frames at 704x1280 on one
    80 GiB GPU: what a user's first run would ask."""
    from miles_cli.main import main

    flags = {
        "hf_checkpoint": REAL,
        "prompt_data": "digits-edit:train",
        "rm_type": "digit_edit",
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 8,
        "rollout_microgroup_size": 8,
        "global_batch_size": 64,
        "micro_batch_size": 1,
        "diffusion_num_steps": 20,
        "diffusion_num_sde_steps": 2,
        "actor_num_gpus_per_node": 1,
        "num_gpus_per_node": 1,
        "colocate": True,
        "diffusion_height": 704,
        "diffusion_width": 1280,
        "diffusion_output_num_frames": 33,
        "diffusion_guidance_scale": 5.0,
        "diffusion_forward_dtype": "bf16",
        "gradient_checkpointing": True,
        "use_lora": True,
        "lora_rank": 64,
        "lora_alpha": 128,
        "gpu_memory_gib": 80,
    }
    argv = ["plan", "--job", "rl"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    rc = main(argv)
    out = capsys.readouterr()
    peak = float(re.search(r"memory: peak ([\d.]+) GiB per GPU", out.out).group(1))  # type: ignore[union-attr]
    print(f"TI2V-5B LoRA GRPO plan: peak {peak} GiB per GPU")
    assert rc == 0 and "fits" in out.out, out.err
    assert peak < 80


# ---- the tiny build through the engine -----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_build_loads_as_a_ti2v_pipeline(tiny_wan2_2_ti2v_dir: Path, engine: DiffusersEngine) -> None:
    import json

    index = json.loads((tiny_wan2_2_ti2v_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True  # as the hub saves TI2V-5B
    assert index["transformer_2"] == [None, None] and index["boundary_ratio"] is None
    assert engine.family.name == "wan2_2_ti2v"
    pipe = engine.pipe
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.config.expand_timesteps
    assert pipe.transformer_2 is None and engine.transformer is pipe.transformer
    z = pipe.vae.config.z_dim
    assert pipe.transformer.config.in_channels == pipe.transformer.config.out_channels == z


@pytest.mark.slow
def test_noise_level_zero_reproduces_the_pipeline(engine: DiffusersEngine, digit_pngs, monkeypatch) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    # the I2V pipeline cleans prompts with ftfy unconditionally (not installed here); WanPipeline's cleaning is the
    # same without it, and is what the family encodes with
    monkeypatch.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)
    seeds = [5, 6]
    samples = engine.generate([_request(digit_pngs[0], 0.0, [[], []], seeds)])
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
            # at the tiny VAE's temporal factor 1 the pipeline turns 8 frames into 9 (F // 1 * 1 + 1)
            num_frames=FRAMES - 1 if pipe.vae_scale_factor_temporal == 1 else FRAMES,
            num_videos_per_prompt=2,
            guidance_scale=4.0,
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
    assert ours.shape == ref.shape == (2, z, FRAMES, 16, 16)
    latent_diff = (ours - ref).abs().max().item()
    assert latent_diff <= 1e-5
    got = torch.stack([s.image for s in samples])  # [B, 3, F, H, W]
    video_diff = (got - video.permute(0, 2, 1, 3, 4)).abs().max().item()
    assert video_diff <= 1e-5
    print(f"max |engine - the pipeline (expand_timesteps)|: latents {latent_diff:.3g}, video {video_diff:.3g}")
    # the first frame's latents are recorded with both branches, and every recorded latent holds them on frame 0
    cond = samples[0].conditions
    c0 = cond.positive["first_frame"]
    assert c0.shape == (z, 1, 16, 16) and torch.equal(cond.negative["first_frame"], c0)
    for sample in samples:
        assert all(torch.equal(x[:, :1], c0) for x in sample.trajectory.latents[1:])
    assert len(samples[0].sources) == 1 and samples[0].sources[0].shape == (3, 64, 64)


@pytest.mark.slow
def test_the_first_frame_changes_the_video(engine: DiffusersEngine, digit_pngs) -> None:
    a = engine.generate([_request(digit_pngs[0], 0.0, [[]], [5])])[0]
    b = engine.generate([_request(digit_pngs[1], 0.0, [[]], [5])])[0]
    assert (a.trajectory.latents[-1][:, 1:] - b.trajectory.latents[-1][:, 1:]).abs().max().item() > 1e-3


def _recompute(sample, i: int, family, denoiser, next_latent=None, latent=None, mask=True):
    """The trainer's recompute of step `i` of `sample` (its recorded latents unless given)."""
    traj = sample.trajectory
    pos = stack_conditions([sample], negative=False, family=family)
    neg = stack_conditions([sample], negative=True, family=family)
    x = (traj.latents[i] if latent is None else latent)[None]
    v = family.guided_velocity(denoiser, x, traj.timesteps[i].expand(1), pos, neg, sample.conditions.guidance_scale)
    step_mask = family.step_mask(tuple(x.shape[1:])) if mask else None
    return sde_step(
        v,
        x,
        traj.sigmas[i],
        traj.sigmas[i + 1],
        sde_type="sde",
        noise_level=0.7,
        sigma_max=traj.sigmas[1],
        prev_sample=(traj.latents[i + 1] if next_latent is None else next_latent)[None],
        mask=step_mask,
    )


def _recompute_drift(samples, sde_steps, family, denoiser) -> float:
    drift = 0.0
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.sde_step_indices == steps and traj.log_probs.shape == (len(steps),)
        for j, i in enumerate(steps):
            drift = max(drift, abs(_recompute(sample, i, family, denoiser).log_prob.item() - traj.log_probs[j].item()))
    return drift


@pytest.mark.slow
def test_recorded_log_probs_are_reproduced_by_a_recompute(engine: DiffusersEngine, digit_pngs) -> None:
    sde_steps = [[0, 1, 3], [3, 4], [5]]
    samples = engine.generate([_request(digit_pngs[0], 0.7, sde_steps, seeds=(11, 12, 13))])
    drift = _recompute_drift(samples, sde_steps, engine.family, engine.transformer)
    print(f"log-prob drift (engine's denoiser): {drift:.3g}")
    assert drift <= 1e-6
    c0 = samples[0].conditions.positive["first_frame"]
    for sample in samples:  # the SDE steps gave frame 0 no noise
        assert all(torch.equal(x[:, :1], c0) for x in sample.trajectory.latents[1:])


@pytest.mark.slow
def test_frozen_weights_log_prob_drift(engine: DiffusersEngine, digit_pngs, tiny_wan2_2_ti2v_dir: Path) -> None:
    """The trainer's own transformer, loaded from the checkpoint (`load_denoiser`, fp32) on a family of its own
    bound to the run's flags: with frozen weights its recompute of the recorded SDE steps is the rollout's."""
    from miles.training.model import family_of

    family = family_of(engine.args)
    denoiser = family.load_denoiser(tiny_wan2_2_ti2v_dir, torch.float32)
    sde_steps = [[0, 2], [4, 5]]
    samples = engine.generate([_request(digit_pngs[1], 0.7, sde_steps, seeds=(21, 22))])
    with torch.no_grad():
        drift = _recompute_drift(samples, sde_steps, family, denoiser)
    print(f"log-prob drift (trainer's frozen denoiser): {drift:.3g}")
    assert drift <= 1e-6


@pytest.mark.slow
def test_frame_0_contributes_nothing_to_the_log_prob_nor_the_kl(engine: DiffusersEngine, digit_pngs) -> None:
    """Changing frame 0 of a recorded next latent (or of the step's input) leaves the log-prob and the KL's scored
    means as they were; without the family's mask the same change moves the log-prob."""
    (sample,) = engine.generate([_request(digit_pngs[0], 0.7, [[1, 2]], seeds=(31,))])
    family, denoiser = engine.family, engine.transformer
    traj = sample.trajectory
    base = _recompute(sample, 1, family, denoiser)
    moved = traj.latents[2].clone()
    moved[:, 0] += torch.randn_like(moved[:, 0])
    other = _recompute(sample, 1, family, denoiser, next_latent=moved)
    assert other.log_prob.item() == base.log_prob.item()
    shifted_in = traj.latents[1].clone()
    shifted_in[:, 0] += 3.0
    other_in = _recompute(sample, 1, family, denoiser, latent=shifted_in)
    assert other_in.log_prob.item() == base.log_prob.item()
    keep = family.step_mask(tuple(traj.latents[1].shape)).flatten()
    assert torch.equal(other_in.mean.flatten(1)[:, keep], base.mean.flatten(1)[:, keep])  # the KL's elements
    unmasked = _recompute(sample, 1, family, denoiser, mask=False)
    unmasked_moved = _recompute(sample, 1, family, denoiser, next_latent=moved, mask=False)
    assert abs(unmasked_moved.log_prob.item() - unmasked.log_prob.item()) > 1e-3


@pytest.mark.slow
def test_frame_0_contributes_nothing_to_the_sft_nft_and_dpo_losses(engine: DiffusersEngine, digit_pngs) -> None:
    """The trainer's data losses on latents whose frame 0 differs (clean data and noise): the same values, because
    the forward reads frame 0 from the condition and the losses read frames >= 1 (`loss_mask`, NFT's mask)."""
    from types import SimpleNamespace

    from miles.algorithms.dpo import denoising_error
    from miles.algorithms.nft import nft_loss
    from miles.algorithms.sft_loss import noisy_latents
    from miles.training.flow_matching import flow_matching_loss
    from miles.training.pairs import Pair

    (sample,) = engine.generate([_request(digit_pngs[0], 0.0, [[]], seeds=(41,))])
    family, denoiser = engine.family, engine.transformer

    def velocity(x, timesteps, samples, cfg_scale):
        pos = stack_conditions(list(samples), negative=False, family=family)
        return family.guided_velocity(denoiser, x, timesteps, pos)

    trainer = SimpleNamespace(family=family, velocity=velocity)
    gen = torch.Generator().manual_seed(0)
    x0 = sample.trajectory.latents[-1][None].clone()
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.tensor([0.6])
    x0_b, noise_b = x0.clone(), noise.clone()
    x0_b[:, :, 0] = torch.randn(x0_b[:, :, 0].shape, generator=gen)
    noise_b[:, :, 0] = torch.randn(noise_b[:, :, 0].shape, generator=gen)
    shape = tuple(x0.shape[1:])

    def sft(clean, eps):
        inputs = {"latents": noisy_latents(clean, eps, sigma), "timesteps": sigma * 1000.0, "sigmas": sigma}
        inputs |= {"clean_latents": clean, "noise": eps, "guidance_scale": None, "data_mask": family.loss_mask(shape)}
        return flow_matching_loss(trainer, [Pair(sample, 0, 0)], inputs)[0]

    with torch.no_grad():
        a, b = sft(x0, noise), sft(x0_b, noise_b)
        print(f"SFT loss {a.item():.6g} (frame 0 changed: {b.item():.6g})")
        assert a.item() == b.item()

        def nft(clean, eps):
            x_t = noisy_latents(clean, eps, sigma)
            v = velocity(x_t, sigma * 1000.0, [sample], None)
            adv = torch.tensor([1.0])
            return nft_loss(clean, x_t, sigma, v, v * 0.9, adv, mask=family.generated_mask(shape))[0]

        assert nft(x0, noise).item() == nft(x0_b, noise_b).item()

        def dpo(clean, eps):
            v = velocity(noisy_latents(clean, eps, sigma), sigma * 1000.0, [sample], None)
            return denoising_error(v, clean, eps, family.loss_mask(shape))

        assert dpo(x0, noise).item() == dpo(x0_b, noise_b).item()


@pytest.mark.slow
def test_the_memory_plan_traces_a_ti2v_job(tiny_wan2_2_ti2v_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """`inspect-config` of a GRPO job on the built checkpoint traces the actor's step with the example first-frame
    condition ([z, 1, h, w] beside the latents) on fake tensors."""
    from miles_cli.main import main

    flags = {**SMALL, "hf_checkpoint": str(tiny_wan2_2_ti2v_dir), "micro_batch_size": 4}
    flags.pop("diffusion_forward_dtype")
    args = ["inspect-config", "--job", "rl"]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    assert main(args) == 0
    assert "traced actor step (8 x 2x9x16x16" in capsys.readouterr().out
