"""The flux2 (FLUX.2-klein) family's rules and schedule, torch-free and fast: resolved by name and by
`model_index.json`, FLUX.2's empirical shift (the pipeline's own function gives the same values), the torch-free
grid, CFG refused on a distilled klein, sglang refused with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.models.families import family_from_checkpoint_name, get_family, resolve_family
from miles.models.flux2.config import empirical_mu

BASE = {
    "prompt_data": "digits:labels",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "diffusion_num_sde_steps": 1,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def _klein_dir(tmp_path: Path, name: str, distilled: bool) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    index = {"_class_name": "Flux2KleinPipeline", "is_distilled": distilled}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_klein_resolves_by_name_and_is_trainable() -> None:
    for name in ("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-base-9B", "tiny-flux2-klein"):
        assert family_from_checkpoint_name(name) == "flux2", name
    for name in ("black-forest-labs/FLUX.1-dev", "tiny-flux"):
        assert family_from_checkpoint_name(name) == "flux", name
    assert resolve_family("black-forest-labs/FLUX.2-klein-base-4B", require_trainable=True).name == "flux2"


@pytest.mark.parametrize("tokens", [16, 256, 1024, 4096, 4300, 4301, 16384])
@pytest.mark.parametrize("steps", [4, 10, 28, 50, 200])
def test_empirical_mu_is_the_pipelines(tokens: int, steps: int) -> None:
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), abs=1e-12)


def test_measured_klein_schedule_at_1024_px() -> None:
    """4 steps at 1024 x 1024 (4,096 tokens): sigma 1, .967, .908, .767, 0, as the pipeline sets it (conditioned.md);
    the mu depends on the step count (2.291 at 4 steps, 2.023 at 50)."""
    family = get_family("flux2")
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True,
              "time_shift_type": "exponential"}  # fmt: skip
    sigmas, timesteps = family.grid_schedule(config, 4, token_count=4096)
    assert [round(s, 3) for s in sigmas] == [1.0, 0.967, 0.908, 0.767, 0.0]
    assert timesteps[0] == 1000.0 and len(timesteps) == 4
    assert empirical_mu(4096, 4) == pytest.approx(2.291, abs=1e-3)
    assert empirical_mu(4096, 50) == pytest.approx(2.023, abs=1e-3)


def test_cfg_on_a_distilled_klein_is_refused(tmp_path: Path) -> None:
    distilled = _klein_dir(tmp_path, "FLUX.2-klein-4B", distilled=True)
    with pytest.raises(ConfigError) as err:
        resolve("rl", cli={**BASE, "hf_checkpoint": str(distilled), "diffusion_guidance_scale": 4.0})
    message = str(err.value)
    assert "\n" not in message
    assert "--diffusion-guidance-scale 4.0" in message and "distilled FLUX.2-klein" in message
    args = resolve("rl", cli={**BASE, "hf_checkpoint": str(distilled), "diffusion_guidance_scale": 1.0}).args
    assert args.diffusion_model_family == "flux2"
    base = _klein_dir(tmp_path, "FLUX.2-klein-base-4B", distilled=False)
    assert resolve("rl", cli={**BASE, "hf_checkpoint": str(base)}).args.diffusion_guidance_scale == 4.0
    # a hub id that is not in the cache: BFL's names say which is which
    with pytest.raises(ConfigError, match=r"distilled FLUX\.2-klein"):
        resolve("rl", cli={**BASE, "hf_checkpoint": "black-forest-labs/FLUX.2-klein-9B"})
    hub_base = resolve("rl", cli={**BASE, "hf_checkpoint": "black-forest-labs/FLUX.2-klein-base-9B"}).args
    assert hub_base.diffusion_model_family == "flux2"


def test_sglang_is_refused_with_one_line() -> None:
    cli = {**BASE, "hf_checkpoint": "tiny-flux2-klein", "rollout_backend": "sglang", "sglang_python": sys.executable,
           "distributed_backend": "gloo"}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve("rl", cli=cli)
    message = str(err.value)
    assert "\n" not in message and "FLUX.2-klein" in message and "in-process engine" in message


def test_rope_ids_are_exact_integers_at_any_length() -> None:
    """Klein's text ids run to 511: the forward builds them (and the image ids) as int64, as the pipeline does; in
    bf16, the forward dtype of a real run, 257 would become 256."""
    import torch

    from miles.models.flux2.config import ids_grid, text_ids

    ids = text_ids(512, "cpu")
    assert ids.dtype == torch.long and torch.equal(ids[:, 3], torch.arange(512)) and not ids[:, :3].any()
    grid = ids_grid(64, 48, "cpu")
    assert grid.dtype == torch.long and grid.shape == (64 * 48, 4)
    assert grid[-1].tolist() == [0, 63, 47, 0] and grid[48].tolist() == [0, 1, 0, 0]
