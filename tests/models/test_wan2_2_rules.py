"""The frame, expert and guidance flags: honoured by wan2_2, refused with one line where they cannot mean anything."""

from __future__ import annotations

import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError

BASE = {
    "prompt_data": "digits:train",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 1,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}
WAN = {"hf_checkpoint": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "diffusion_output_num_frames": 9}


def _fails(job: str, match: str, **cli) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(job, cli={**BASE, **cli})
    assert match in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        ({"diffusion_output_num_frames": 9}, "makes images"),
        ({"diffusion_guidance_scale_2": 3.0}, "has one transformer"),
        ({"update_weight_target_module": "transformer,transformer_2"}, "trains and syncs transformer"),
        ({"diffusion_fps": 8.0}, "frame rate is for videos"),
    ],
)
def test_image_family_refuses_video_and_expert_flags(cli, match) -> None:
    _fails("rl", match, hf_checkpoint="tiny-sd3", **cli)


def test_image_family_refuses_a_frame_stride_in_sft() -> None:
    _fails("sft", "trains on images", hf_checkpoint="tiny-sd3", prompt_data="digits:sft", sft_frame_stride=2)


def test_wan_needs_the_low_noise_scale_when_it_samples_with_cfg() -> None:
    _fails("rl", "--diffusion-guidance-scale-2 is required for wan2_2", **WAN)
    # without CFG the second scale would be ignored: refused too
    _fails("rl", "runs CFG only when", **WAN, diffusion_guidance_scale=1.0, diffusion_guidance_scale_2=3.0)
    args = resolve("rl", cli={**BASE, **WAN, "diffusion_guidance_scale_2": 3.0}).args
    assert args.diffusion_guidance_scale_2 == 3.0
    # SFT without evaluation never samples: no second scale needed
    sft = {"prompt_data": "digits-video:sft", "actor_num_gpus_per_node": 1, "num_gpus_per_node": 1}
    assert resolve("sft", cli={**WAN, **sft, "global_batch_size": 8}).args.diffusion_guidance_scale_2 is None


def test_wan_target_modules_name_its_experts() -> None:
    _fails(
        "rl",
        "trains and syncs transformer, transformer_2",
        **WAN,
        diffusion_guidance_scale_2=3.0,
        update_weight_target_module="transformer,vae",
    )
    args = resolve(
        "rl", cli={**BASE, **WAN, "diffusion_guidance_scale_2": 3.0, "update_weight_target_module": "transformer_2"}
    ).args
    assert list(args.update_weight_target_module) == ["transformer_2"]


def test_wan_frames_must_fit_the_temporal_factor() -> None:
    from types import SimpleNamespace

    from miles.models.families import get_family

    pipe = SimpleNamespace(
        vae_scale_factor_spatial=8, vae_scale_factor_temporal=4, vae=SimpleNamespace(config=SimpleNamespace(z_dim=16))
    )
    family = get_family("wan2_2")
    assert family.latent_shape(pipe, 64, 64, 9) == (16, 3, 8, 8)
    assert family.latent_shape(pipe, 64, 64, 1) == (16, 1, 8, 8)
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4 frames"):
        family.latent_shape(pipe, 64, 64, 8)


def test_wan_dmd2_needs_both_experts() -> None:
    dmd2 = {**BASE, **WAN, "diffusion_output_num_frames": 1, "diffusion_guidance_scale": 1.0}
    dmd2 = {**dmd2, "actor_num_gpus_per_node": 1, "num_gpus_per_node": 2, "global_batch_size": 4}
    with pytest.raises(ConfigError) as err:
        resolve("dmd2", cli=dmd2)
    assert "needs both experts" in str(err.value) and "\n" not in str(err.value)
    args = resolve("dmd2", cli={**dmd2, "update_weight_target_module": "transformer,transformer_2"}).args
    assert args.update_weight_target_module in ("transformer,transformer_2", ["transformer", "transformer_2"])
