"""The z_image family's rules and schedule, torch-free and fast (torch only to compare): resolved by name, the
pipeline's float32 sigma grid reproduced without torch, Z-Image's CFG convention (`pos + s (pos - neg)`, on for
any s > 0), a negative scale and sglang refused with one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.models.families import family_from_checkpoint_name, get_family

BASE = {
    "hf_checkpoint": "tiny-z-image",
    "prompt_data": "digits:labels",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 1,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def _fails(**cli) -> str:
    with pytest.raises(ConfigError) as err:
        resolve("rl", cli={**BASE, **cli})
    message = str(err.value)
    assert "\n" not in message
    return message


def test_z_image_resolves_by_name() -> None:
    for name in ("Tongyi-MAI/Z-Image-Turbo", "Tongyi-MAI/Z-Image", "tiny-z-image"):
        assert family_from_checkpoint_name(name) == "z_image", name


def test_sigma_grid_is_the_pipelines_float32_linspace() -> None:
    import torch
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    family = get_family("z_image")
    for n in range(1, 101):
        ours = family.sigma_grid(n)
        assert ours.dtype == np.float32
        assert np.array_equal(ours, torch.tensor(get_default_z_image_sigmas(n), dtype=torch.float32).numpy()), n
    # numpy's float64 grid differs from it in the last bit somewhere (why the family overrides it)
    assert any(
        not np.array_equal(np.linspace(1.0, 1.0 / n, n).astype(np.float32), family.sigma_grid(n)) for n in range(2, 30)
    )


def test_turbo_schedule_at_8_steps() -> None:
    """Static shift 3 over the 8-step grid: sigma 1, .955, .900, .833, .750, .643, .500, .300, 0 (Turbo's)."""
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": False}
    sigmas, _ = get_family("z_image").grid_schedule(config, 8, token_count=4096)
    assert [round(s, 3) for s in sigmas] == [1.0, 0.955, 0.9, 0.833, 0.75, 0.643, 0.5, 0.3, 0.0]


def test_cfg_convention() -> None:
    """s = 0 (Turbo) is one branch; any s > 0 runs CFG as standard CFG at 1 + s, combined as the pipeline does."""
    import torch

    family = get_family("z_image")
    assert family.cfg_scale(0.0) == 1.0 and family.cfg_scale(0.5) == 1.5 and family.cfg_scale(3.0) == 4.0
    pos, neg = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    assert torch.equal(family.cfg_combine(pos, neg, 4.0), pos + 3.0 * (pos - neg))
    args = resolve("rl", cli={**BASE, "diffusion_guidance_scale": 0.0}).args
    assert args.diffusion_model_family == "z_image"


def test_negative_scale_and_sglang_are_refused() -> None:
    message = _fails(diffusion_guidance_scale=-1.0)
    assert message == "--diffusion-guidance-scale: -1.0 is below the minimum 0"
    message = _fails(rollout_backend="sglang", sglang_python=sys.executable, distributed_backend="gloo")
    assert "Z-Image" in message and "in-process engine" in message
