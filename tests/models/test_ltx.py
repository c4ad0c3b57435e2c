"""ltx (LTX-2) through the in-process engine and the trainer, on the embedded tiny-ltx2 (video + audio, 9 frames).

The family's latent holds both streams (video channels, then the audio tokens on extra planes). Noise level 0
reproduces `LTX2Pipeline` (same initial video and audio noise, same Euler sigmas) to 1e-5 in both streams and in
the decoded video; with noise, the video steps by SDE and the audio by ODE (as sglang steps LTX-2), and the
trainer's recompute gives back the rollout's log-probs; `--debug-skip-optimizer-step` measures a log-prob
difference of 0.0; `--rollout-patch-group ltx` makes the video velocity independent of the audio latents.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch

from miles.builtin.tiny.ltx import LATENT_CHANNELS as CV
from miles.builtin.tiny.ltx import LATENT_SIZE as LS
from miles.config.resolve import resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

pytestmark = pytest.mark.slow

PROMPT = "the digit 3 moving right"
FRAMES, FPS = 9, 8.0
SMALL = {
    "prompt_data": "digits-video:labels",
    "rm_type": "digit",
    "rollout_batch_size": 1,
    "n_samples_per_prompt": 2,
    "rollout_microgroup_size": 2,
    "global_batch_size": 2,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "distributed_backend": "gloo",
    "diffusion_forward_dtype": "fp32",
    "diffusion_height": 64,
    "diffusion_width": 64,
    "diffusion_output_num_frames": FRAMES,
    "diffusion_fps": FPS,
    "diffusion_guidance_scale": 1.0,
    "lr": 1e-2,
}
UNGUIDED = {  # LTX2Pipeline with every guidance term off: one forward a step, the family's unguided sampling
    "guidance_scale": 1.0,
    "stg_scale": 0.0,
    "modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_guidance_scale": 1.0,
    "audio_stg_scale": 0.0,
    "audio_modality_scale": 1.0,
    "audio_guidance_rescale": 0.0,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(checkpoint: Path, **cli):
    return resolve("rl", cli={**SMALL, "hf_checkpoint": str(checkpoint), **cli}).args


@pytest.fixture(scope="module")
def engine(tiny_ltx2_dir: Path) -> DiffusersEngine:
    return DiffusersEngine(_args(tiny_ltx2_dir), device="cpu")


def _request(noise_level: float, sde_steps: list[list[int]], seeds) -> GenerateRequest:
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 3, "direction": "right"},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=6,
        guidance_scale=1.0,
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        num_frames=FRAMES,
        fps=FPS,
    )


def test_the_joint_latent_holds_video_then_audio(engine: DiffusersEngine) -> None:
    family, pipe = engine.family, engine.pipe
    shape = family.latent_shape(pipe, 64, 64, FRAMES)
    # CV video channels of 9 x LS x LS; 28 audio tokens x 16 (= 9 frames / 8 fps * 25 per s) fill k more planes
    assert shape == (CV + math.ceil(28 * 16 / (9 * LS * LS)), 9, LS, LS)
    mask = family.sde_mask(shape)
    assert mask[:CV].all() and not mask[CV:].any()
    x = torch.randn(2, *shape)
    video, audio, frames = family.split(pipe.transformer, x, FPS)
    assert video.shape == (2, 9 * LS * LS, CV) and audio.shape == (2, 28, 16) and frames == 28
    joined = family.join(video, audio, x)
    assert torch.equal(joined[:, :CV], x[:, :CV])
    assert torch.equal(joined[:, CV:].reshape(2, -1)[:, : 28 * 16], x[:, CV:].reshape(2, -1)[:, : 28 * 16])
    assert not joined[:, CV:].reshape(2, -1)[:, 28 * 16 :].any()  # the padding's velocity is 0


def test_noise_level_zero_reproduces_the_pipeline_video_and_audio(engine: DiffusersEngine) -> None:
    family, pipe = engine.family, engine.pipe
    samples = engine.generate([_request(0.0, [[], []], (5, 6))])
    first = torch.stack([s.trajectory.latents[0] for s in samples])
    last = torch.stack([s.trajectory.latents[-1] for s in samples])
    video0, audio0, frames = family.split(pipe.transformer, first, FPS)
    common = dict(
        prompt=PROMPT,
        height=64,
        width=64,
        num_frames=FRAMES,
        frame_rate=FPS,
        num_inference_steps=6,
        num_videos_per_prompt=2,
        max_sequence_length=engine.max_sequence_length,
        latents=video0,  # packed [B, S, C]: used as given (a 5-D latent would be normalised again)
        audio_latents=audio0,  # packed [B, L, D]: the tiny audio VAE's normalisation is the identity
        **UNGUIDED,
    )
    ref = pipe(**common, output_type="latent")
    vae = pipe.vae
    ours_video = last[:, :CV] * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor
    ours_video = ours_video + vae.latents_mean.view(1, -1, 1, 1, 1)
    assert ref.frames.shape == ours_video.shape == (2, CV, FRAMES, LS, LS)
    assert (ours_video - ref.frames).abs().max().item() <= 1e-5
    _, audio_last, _ = family.split(pipe.transformer, last, FPS)
    ours_audio = pipe._unpack_audio_latents(audio_last, frames, num_mel_bins=4)
    assert ref.audio.shape == ours_audio.shape == (2, 4, 28, 4)
    assert (ours_audio - ref.audio).abs().max().item() <= 1e-5
    assert ref.audio.abs().max().item() > 0.1  # the audio stream was really denoised
    videos = pipe(**common, output_type="pt").frames.float()  # [B, F, 3, H, W]
    got = torch.stack([s.image for s in samples])
    assert got.shape == (2, 3, FRAMES, 64, 64)
    assert (got - videos.permute(0, 2, 1, 3, 4)).abs().max().item() <= 1e-5


def test_video_steps_by_sde_audio_by_ode_and_the_recompute_gives_the_log_probs_back(engine: DiffusersEngine) -> None:
    family = engine.family
    sde_steps = [[0, 2], [1, 4]]
    samples = engine.generate([_request(0.7, sde_steps, seeds=(11, 12))])
    worst = 0.0
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.log_probs.shape == (2,)
        pos = stack_conditions([sample], negative=False, family=family)
        assert torch.equal(pos["fps"], torch.tensor([[FPS]]))
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(engine.transformer, x, traj.timesteps[i].expand(1), pos, None, 1.0)
            mask = family.sde_mask(tuple(x.shape[1:]))
            res = sde_step(
                v,
                x,
                traj.sigmas[i],
                traj.sigmas[i + 1],
                sde_type="sde",
                noise_level=0.7,
                sigma_max=traj.sigmas[1],
                prev_sample=traj.latents[i + 1][None],
                mask=mask,
            )
            worst = max(worst, abs(res.log_prob.item() - traj.log_probs[j].item()))
            euler = sde_step(v, x, traj.sigmas[i], traj.sigmas[i + 1], sde_type="ode", noise_level=0.0)
            nxt = traj.latents[i + 1][None]
            # audio (and padding): the ODE step (up to the batch-of-2 vs batch-of-1 forward's rounding)
            assert (nxt[:, CV:] - euler.prev_sample[:, CV:]).abs().max().item() <= 1e-5
            assert (nxt[:, :CV] - euler.prev_sample[:, :CV]).abs().max().item() > 0.1  # video: noise added
    assert worst <= 1e-6


def test_the_ltx_patch_group_cuts_the_video_off_the_audio(engine: DiffusersEngine, tiny_ltx2_dir: Path) -> None:
    family, pipe = engine.family, engine.pipe
    shape = family.latent_shape(pipe, 64, 64, FRAMES)
    torch.manual_seed(0)
    x = torch.randn(1, *shape)
    other = x.clone()
    other[:, CV:] = torch.randn(1, *other[:, CV:].shape)  # different audio latents, the same video
    pos, _ = family.encode_prompts(pipe, [PROMPT], None, False, engine.max_sequence_length, geometry={"fps": FPS})
    t = torch.tensor([700.0])
    joint = [family.forward_velocity(pipe.transformer, z, t, pos) for z in (x, other)]
    assert (joint[0][:, :CV] - joint[1][:, :CV]).abs().max().item() > 1e-4  # a2v attention: video reads audio
    patched = DiffusersEngine(_args(tiny_ltx2_dir, rollout_patch_group=["ltx"]), device="cpu").family
    assert patched.isolate_modalities and not family.isolate_modalities
    cut = [patched.forward_velocity(pipe.transformer, z, t, pos) for z in (x, other)]
    assert torch.equal(cut[0][:, :CV], cut[1][:, :CV])  # the video velocity no longer depends on the audio
    assert (cut[0][:, CV:] - cut[1][:, CV:]).abs().max().item() > 1e-4  # audio still denoises its own input


@pytest.mark.parametrize("patch_group", [None, ["ltx"]])
def test_the_trainer_replays_the_rollout_exactly_and_trains(tiny_ltx2_dir: Path, patch_group) -> None:
    from miles.rollout.manager import RolloutManager
    from miles.training.trainer import Trainer

    extra = {} if patch_group is None else {"rollout_patch_group": patch_group}
    # the reference's LTX step strategy (SDE steps shared by every sample) and a micro-batch that is the rollout's
    # microgroup at one step: the trainer's forward is then the engine's own batch, bit for bit
    replay = {
        "diffusion_step_strategy_path": "miles.sampling.step_strategies.epoch_global_random_choice",
        "diffusion_sde_candidate_steps": "0,1,2,3,4",
        "micro_batch_size_sample": 2,
        "micro_batch_size_tstep": 1,
        "diffusion_train_iter_order": "timestep_major",
    }
    args = _args(tiny_ltx2_dir, debug_skip_optimizer_step=True, **replay, **extra)
    manager = RolloutManager(args)
    batch = manager.generate(0)
    assert all(len(s.trajectory.sde_step_indices) == 2 for s in batch.samples)
    trainer = Trainer(args, master_port=_free_port())
    assert trainer.family.isolate_modalities == (patch_group is not None)
    metrics = trainer.train(0, batch.samples)
    assert metrics["log_prob_abs_diff_first_step"] == 0.0  # the in-process engine's forward, replayed exactly
    assert metrics["log_prob_mean_abs_diff"] == 0.0
    trainer.args.debug_skip_optimizer_step = False
    metrics = trainer.train(0, batch.samples)
    assert metrics["grad_norm"] > 0
    engine = manager.engines[0]
    before = {k: v.clone() for k, v in engine.transformer.state_dict().items()}
    engine.update_weights(trainer.engine_weights())
    after = engine.transformer.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_video_only_sft_encodes_zero_audio_and_trains_the_video_stream_alone(
    engine: DiffusersEngine, tiny_ltx2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`miles train sft` for ltx (with the `ltx` patch group, which it requires): the clip's video latent and
    zero audio planes; the loss reads the video channels only and the video does not attend to the audio, so
    other audio planes give the same loss bit for bit; a step moves the DiT."""
    from miles.core.sample import Conditions, Sample
    from miles.training.model import family_of
    from miles.training.trainer import Trainer

    sft = {k: v for k, v in SMALL.items() if not k.startswith(("rollout_", "n_samples", "diffusion_num_sde"))}
    sft |= {"prompt_data": "digits-video:sft", "micro_batch_size": 2, "rollout_patch_group": ["ltx"]}
    cli = {**sft, "hf_checkpoint": str(tiny_ltx2_dir), "debug_skip_optimizer_step": True}
    args = resolve("sft", cli=cli).args
    family = family_of(args)
    family.bind_checkpoint(tiny_ltx2_dir)  # as encode_sft_dataset does: the DiT's config without the DiT
    encoder = family.load_pipeline_class().from_pretrained(tiny_ltx2_dir, transformer=None, dtype=torch.float32)
    torch.manual_seed(0)
    pixels = torch.rand(2, 3, FRAMES, 64, 64) * 2 - 1
    x0 = family.encode_images(encoder, pixels)
    assert x0.shape == (2, *engine.family.latent_shape(engine.pipe, 64, 64, FRAMES))
    assert torch.equal(x0[:, CV:], torch.zeros_like(x0[:, CV:]))
    # the normalisation is decode's inverse: decoding the encoded clip is the VAE's own round trip
    vae = engine.pipe.vae
    own = (vae.decode(vae.encode(pixels).latent_dist.mean, torch.zeros(2), return_dict=False)[0] / 2 + 0.5).clamp(0, 1)
    assert (family.decode_latents(engine.pipe, x0) - own).abs().max().item() < 1e-5

    max_len = engine.max_sequence_length
    pos, _ = family.encode_prompts(engine.pipe, [PROMPT], None, False, max_len, geometry={"fps": FPS})
    cond = Conditions({k: v[0].float() for k, v in pos.items()}, None, 1.0)
    samples = [Sample(index=i, group_index=i, prompt=PROMPT, conditions=cond) for i in range(2)]
    trainer = Trainer(args, master_port=_free_port(), total_steps=2)
    noisy_audio = x0.clone()
    noisy_audio[:, CV:] = torch.randn_like(noisy_audio[:, CV:])
    runs = []
    for latents in (x0, noisy_audio):
        trainer.generator.manual_seed(0)
        runs.append(trainer.train_sft(latents, samples))
    assert runs[0]["loss"] == runs[1]["loss"] > 0
    # a custom SFT loss gets the same mask in its batch (`data_mask`): sft_loss written as a hook matches
    hook = {"loss_type": "custom_loss", "custom_loss_function_path": "train_hooks_helpers.sft_as_custom_loss"}
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "training"))
    custom = Trainer(resolve("sft", cli={**cli, **hook}).args, master_port=_free_port(), total_steps=2)
    custom.generator.manual_seed(0)
    assert custom.train_sft(x0, samples)["loss"] == runs[0]["loss"]
    before = {k: v.clone() for k, v in trainer.engine_weights().items()}
    trainer.args.debug_skip_optimizer_step = False
    assert trainer.train_sft(x0, samples)["grad_norm"] > 0
    after = trainer.engine_weights()
    assert any(not torch.equal(after[k], before[k]) for k in before)
