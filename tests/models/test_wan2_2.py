"""wan2_2 through the in-process engine and the trainer, on the embedded tiny-wan2_2 (two experts, 9 frames).

Noise level 0 reproduces `WanPipeline` (with the Euler scheduler the rollouts use) to 1e-5 in latents and
videos with both experts running; the trainer's recompute gives back the rollout's log-probs; the experts
route per row; `--update-weight-target-module` trains and syncs only the experts it names, leaving the
other one bit-identical on the engine, and confines the SDE steps to the trained expert's.
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

PROMPT = "the digit 3 moving right"
FRAMES = 9
SMALL = {
    "prompt_data": "digits-video:labels",
    "rm_type": "digit",
    "rollout_batch_size": 1,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 4,
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
    "diffusion_output_num_frames": FRAMES,
    "diffusion_guidance_scale": 4.0,
    "diffusion_guidance_scale_2": 3.0,
    "lr": 1e-2,
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(checkpoint: Path, **cli):
    return resolve("rl", cli={**SMALL, "hf_checkpoint": str(checkpoint), **cli}).args


@pytest.fixture(scope="module")
def engine(tiny_wan2_2_dir: Path) -> DiffusersEngine:
    return DiffusersEngine(_args(tiny_wan2_2_dir), device="cpu")


def _request(noise_level: float, sde_steps: list[list[int]], seeds, steps: int = 6) -> GenerateRequest:
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 3, "direction": "right"},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=steps,
        guidance_scale=4.0,
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        num_frames=FRAMES,
        guidance_scale_2=3.0,
    )


def test_noise_level_zero_reproduces_the_pipeline_with_both_experts(engine: DiffusersEngine) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    seeds = [5, 6]
    samples = engine.generate([_request(0.0, [[], []], seeds)])
    timesteps = samples[0].trajectory.timesteps
    # shift 12 at 6 steps: four high-noise steps, then two low-noise ones (families.md: HHHHLL)
    assert [engine.transformer.expert_for(t) for t in timesteps] == ["transformer"] * 4 + ["transformer_2"] * 2
    pipe = engine.pipe
    shipped = pipe.scheduler
    assert type(shipped).__name__ == "UniPCMultistepScheduler"  # as the hub ships it; rollouts step with Euler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shipped.config.flow_shift)
    try:
        common = dict(
            prompt=PROMPT,
            num_inference_steps=6,
            height=64,
            width=64,
            # WanPipeline rounds a frame count F with F % factor != 1 to F // factor * factor + 1: at the tiny VAE's
            # temporal factor 1 that turns 9 into 10, so 8 asks it for 9
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
    assert ours.shape == ref.shape == (2, pipe.vae.config.z_dim, FRAMES, 16, 16)
    assert (ours - ref).abs().max().item() <= 1e-5
    got = torch.stack([s.image for s in samples])
    assert got.shape == (2, 3, FRAMES, 64, 64)
    assert (got - video.permute(0, 2, 1, 3, 4)).abs().max().item() <= 1e-5
    cond = samples[0].conditions
    assert cond.guidance_scale == 4.0 and cond.guidance_scale_2 == 3.0 and cond.negative is not None


def test_recorded_log_probs_are_reproduced_by_a_recompute(engine: DiffusersEngine) -> None:
    sde_steps = [[0, 1, 4], [2, 3, 5]]  # both experts' steps
    samples = engine.generate([_request(0.7, sde_steps, seeds=(11, 12))])
    family = engine.family
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        pos = stack_conditions([sample], negative=False, family=family)
        neg = stack_conditions([sample], negative=True, family=family)
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(engine.transformer, x, traj.timesteps[i].expand(1), pos, neg, 4.0, 3.0)
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


def test_experts_route_each_row_and_guide_at_their_own_scale(engine: DiffusersEngine) -> None:
    """A batch that mixes the phases gives each row what its expert alone gives, at its expert's CFG scale."""
    family, experts = engine.family, engine.transformer
    torch.manual_seed(0)
    x = torch.randn(3, *family.latent_shape(engine.pipe, 64, 64, FRAMES))
    t = torch.tensor([990.0, 500.0, 900.0])
    pos, neg = family.encode_prompts(engine.pipe, [PROMPT] * 3, None, True, engine.max_sequence_length)
    mixed = family.guided_velocity(experts, x, t, pos, neg, 4.0, 3.0)
    for row, (expert, scale) in enumerate([(engine.pipe.transformer, 4.0), (engine.pipe.transformer_2, 3.0)] * 2):
        if row == 2:
            break
        one = {k: v[row : row + 1] for k, v in pos.items()}
        one_neg = {k: v[row : row + 1] for k, v in neg.items()}
        alone = family.guided_velocity(expert, x[row : row + 1], t[row : row + 1], one, one_neg, scale)
        assert (mixed[row] - alone[0]).abs().max().item() <= 1e-5
    row3 = family.guided_velocity(
        engine.pipe.transformer,
        x[2:],
        t[2:],
        {k: v[2:] for k, v in pos.items()},
        {k: v[2:] for k, v in neg.items()},
        4.0,
    )
    assert (mixed[2] - row3[0]).abs().max().item() <= 1e-5


def test_one_expert_trains_and_syncs_the_other_stays_bit_identical(tiny_wan2_2_dir: Path) -> None:
    from miles.rollout.manager import RolloutManager
    from miles.training.trainer import Trainer

    for trained, frozen, steps in (
        ("transformer_2", "transformer", {4, 5}),
        ("transformer", "transformer_2", {0, 1, 2, 3}),
    ):
        args = _args(tiny_wan2_2_dir, update_weight_target_module=trained)
        manager = RolloutManager(args)
        batch = manager.generate(0)
        drawn = {i for s in batch.samples for i in s.trajectory.sde_step_indices}
        assert drawn and drawn <= steps, (trained, drawn)  # SDE steps only where the trained expert denoises
        engine = manager.engines[0]
        before = {k: v.clone() for k, v in engine.transformer.state_dict().items()}
        trainer = Trainer(args, master_port=_free_port())
        assert [n for n, _ in trainer.model.named_children()] == [trained]  # only the named expert is loaded
        metrics = trainer.train(0, batch.samples)
        assert metrics["grad_norm"] > 0
        weights = trainer.engine_weights()
        assert weights and all(k.startswith(trained + ".") for k in weights)
        engine.update_weights(weights)
        after = engine.transformer.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before if k.startswith(frozen + "."))
        assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith(trained + "."))


def test_confined_steps_refuse_a_window_outside_the_trained_expert(tiny_wan2_2_dir: Path) -> None:
    from miles.rollout.manager import trained_expert_steps
    from miles.sampling.step_strategies import select_steps

    args = _args(tiny_wan2_2_dir, update_weight_target_module="transformer_2")
    assert trained_expert_steps(args, 6) == [4, 5]
    assert trained_expert_steps(_args(tiny_wan2_2_dir, update_weight_target_module="transformer"), 6) == [0, 1, 2, 3]
    assert (
        trained_expert_steps(_args(tiny_wan2_2_dir, update_weight_target_module="transformer,transformer_2"), 6)
        is None
    )
    for seed in range(5):
        steps, _ = select_steps(args, None, 6, seed, None, [4, 5])
        assert steps == [4, 5]
    args.diffusion_sde_window_range = "0,3"
    with pytest.raises(ValueError, match=r"none of the trained experts' steps 4\.\.5"):
        select_steps(args, None, 6, 0, None, [4, 5])
