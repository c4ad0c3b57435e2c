"""The ltx family's rules (torch-free, fast): unguided, no negative prompt, no custom SDE backend, Flow-GRPO and
video-only SFT (with the `ltx` patch group),
sglang refused with one line naming the family and why (auto picks the in-process engine), and
`--rollout-patch-group ltx` honoured for ltx alone."""

from __future__ import annotations

import sys

import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.models.families import get_family, resolve_family

BASE = {
    "prompt_data": "digits-video:labels",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 1,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "diffusion_output_num_frames": 9,
    "diffusion_guidance_scale": 1.0,
}
LTX = {"hf_checkpoint": "Lightricks/LTX-2"}
SGLANG = {"rollout_backend": "sglang", "sglang_python": sys.executable, "distributed_backend": "gloo"}


def _fails(job: str, **cli) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(job, cli={**BASE, **LTX, **cli})
    message = str(err.value)
    assert "\n" not in message
    return message


def test_ltx_resolves_by_name_and_is_trainable() -> None:
    family = resolve_family("Lightricks/LTX-2.3", require_trainable=True)
    assert family.name == "ltx" and family.trainable and family.makes_video
    assert resolve_family("tiny-ltx2", require_trainable=True).name == "ltx"
    args = resolve("rl", cli={**BASE, **LTX}).args
    assert args.rollout_backend == "diffusers"  # auto: sglang cannot serve ltx


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        ({"diffusion_guidance_scale": 4.0}, "trains unguided"),
        ({"diffusion_negative_prompt": "blurry"}, "takes no negative prompt"),
        ({"sde_step_backend_path": "miles.sampling.sde_backends.CpsSdeStepBackend"}, "custom backend"),
        (
            {"loss_type": "nft", "use_ema": True, "diffusion_sde_type": "ode", "diffusion_noise_level": 0.0},
            "Flow-GRPO",
        ),
    ],
)
def test_ltx_refuses_what_it_cannot_honour(cli, match) -> None:
    assert match in _fails("rl", **cli)


def test_sglang_is_refused_for_ltx_naming_the_family_and_the_mode() -> None:
    message = _fails("rl", **SGLANG)
    assert "--rollout-backend sglang" in message and "model family 'ltx'" in message
    assert "audio" in message and "--rollout-backend diffusers" in message
    # with the patch group too: the sglang server would not carry it, and it still returns no audio
    assert "model family 'ltx'" in _fails("rl", **SGLANG, rollout_patch_group=["ltx"])


def test_other_families_stay_servable_by_sglang() -> None:
    assert all(get_family(k).sglang_unserved == "" for k in ("sd3", "flux", "qwen_image", "wan2_2"))


def test_the_ltx_patch_group_is_honoured_for_ltx_only() -> None:
    args = resolve("rl", cli={**BASE, **LTX, "rollout_patch_group": ["ltx"]}).args
    assert args.rollout_patch_group == ["ltx"]
    family = get_family("ltx")
    family.bind_args(args)
    assert family.isolate_modalities
    family.bind_args(resolve("rl", cli={**BASE, **LTX}).args)
    assert not family.isolate_modalities
    # another group with ltx, or the ltx group with another family: refused as before
    assert "nothing to patch" in _fails("rl", rollout_patch_group=["ltx", "wan"])
    with pytest.raises(ConfigError, match="nothing to patch"):
        resolve("rl", cli={**BASE, "hf_checkpoint": "tiny-wan2_2", "rollout_patch_group": ["ltx"]})


def test_bind_args_reads_the_frame_rate() -> None:
    family = get_family("ltx")
    family.bind_args(resolve("rl", cli={**BASE, **LTX, "diffusion_fps": 8.0}).args)
    assert family.fps == 8.0
    family.bind_args(resolve("rl", cli={**BASE, **LTX}).args)
    assert family.fps == 24.0  # LTX2Pipeline's default frame rate


def test_sft_needs_the_ltx_patch_group_since_the_data_has_no_audio() -> None:
    sft = {"prompt_data": "digits-video:sft", "global_batch_size": 8}
    message = _fails("sft", **sft)
    assert "`miles train sft`" in message and "--rollout-patch-group ltx" in message and "no audio" in message
    args = resolve("sft", cli={**BASE, **LTX, **sft, "rollout_patch_group": ["ltx"]}).args
    assert args.rollout_patch_group == ["ltx"] and args.loss_type == "sft_loss"


def test_dmd2_is_refused_for_ltx() -> None:
    with pytest.raises(ConfigError, match="`miles train dmd2`: model family 'ltx'"):
        resolve("dmd2", cli={**BASE, **LTX, "rollout_patch_group": ["ltx"]})
