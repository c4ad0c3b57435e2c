"""The torch-free denoising grid (`miles.sampling.grid`) against what the engines compute with torch and diffusers:
the family's `schedule` on a diffusers scheduler built from the same config, the step's std from `sde_step` through
the built-in backend, Wan's expert routing; the grids of shared/reference/families.md as literals; and a fresh
interpreter that computes two recipes' grids without importing torch or diffusers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from miles.models.families import get_family
from miles.models.scheduler_grid import live_scheduler_config
from miles.sampling.grid import Grid, compute_grid, denoising_grid, grid_unavailable_reason, shipped_folder
from miles.sampling.grid import step_noise_std as grid_std

ROOT = Path(__file__).resolve().parents[2]
STEPS = (1, 2, 4, 6, 10, 16, 20, 24, 35, 40)
SIZES = ((64, 64), (512, 512), (480, 832), (1024, 1024))
VIDEO_FRAMES = (1, 5, 57, 81)
SHIFTS = (None, 3.0, 7.3)
# family -> (the hub name of the checkpoint miles ships configs for, the tiny builder's module)
FAMILIES = {
    "sd3": ("stabilityai/stable-diffusion-3.5-medium", "miles.builtin.tiny.sd3"),
    "flux": ("black-forest-labs/FLUX.1-dev", "miles.builtin.tiny.flux"),
    "qwen_image": ("Qwen/Qwen-Image", "miles.builtin.tiny.qwen_image"),
    "wan2_2": ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "miles.builtin.tiny.wan2_2"),
    "wan2_2_i2v": ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "miles.builtin.tiny.wan2_2_i2v"),
    "wan2_2_ti2v": ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "miles.builtin.tiny.wan2_2_ti2v"),
    "ltx": ("Lightricks/LTX-2", "miles.builtin.tiny.ltx"),
    "cosmos3": ("nvidia/Cosmos3-Nano", "miles.builtin.tiny.cosmos3"),
}
MEASURED: dict[str, float] = {}  # the largest differences seen (printed with -s)


def _configs(family_name: str, which: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]], Any]:
    """(scheduler config, component configs, the scheduler the engine would hold) of the shipped real checkpoint or
    the tiny build."""
    import importlib

    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    family = get_family(family_name)
    hub, module = FAMILIES[family_name]
    if which == "real":
        folder = shipped_folder(family, hub)
        assert folder is not None
        scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        components = {
            p.name: json.loads((p / "config.json").read_text())
            for p in folder.iterdir()
            if (p / "config.json").is_file()
        }
        cls = {"FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler}.get(
            scheduler["_class_name"], UniPCMultistepScheduler
        )
        return scheduler, components, cls.from_config(scheduler)
    tiny = importlib.import_module(module)
    configs = tiny.grid_configs()
    return configs["scheduler"], {k: v for k, v in configs.items() if k != "scheduler"}, tiny.make_scheduler()


def _engine_shape(family: Any, components: dict[str, Any], height: int, width: int, frames: int) -> tuple[int, ...]:
    """The latent shape the engine passes to `schedule`, computed here from the configs: `latent_shape` on the
    config pipe where it serves, else the family's VAE factors read directly (ltx, cosmos3)."""
    vae = components.get("vae", {})
    if family.name in ("ltx", "cosmos3"):
        if family.name == "ltx":
            spatial, temporal = vae["spatial_compression_ratio"], vae["temporal_compression_ratio"]
        else:
            spatial, temporal = vae["scale_factor_spatial"], vae["scale_factor_temporal"]
        if height % spatial or width % spatial or (frames - 1) % temporal:
            raise ValueError("a size the family refuses")
        return (8, (frames - 1) // temporal + 1, height // spatial, width // spatial)
    return family.latent_shape(family.config_pipe(components), height, width, frames)


def _max_diff(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    assert (np.isnan(a) == np.isnan(b)).all()  # a 1-step terminal stretch is 0/0 in diffusers too
    keep = ~np.isnan(a)
    return float(np.abs(a[keep] - b[keep]).max()) if keep.any() else 0.0


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # 1-step terminal stretch: NaN in both
@pytest.mark.parametrize("which", ["real", "tiny"])
@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_the_grid_equals_the_familys_schedule(family_name: str, which: str) -> None:
    family = get_family(family_name)
    scheduler_config, components, scheduler = _configs(family_name, which)
    frames_list = VIDEO_FRAMES if family.makes_video else (1,)
    worst = 0.0
    cases = 0
    for height, width in SIZES:
        for frames in frames_list:
            try:
                shape = _engine_shape(family, components, height, width, frames)
            except ValueError:
                with pytest.raises(ValueError):
                    family.grid_token_count(components, height, width, frames)
                continue
            count = family.grid_token_count(components, height, width, frames)
            assert count == family.image_seq_len(shape)
            for num_steps in STEPS:
                for shift in SHIFTS:
                    sigmas, timesteps = family.schedule(scheduler, num_steps, shape, shift)
                    grid_sigmas, grid_timesteps = family.grid_schedule(scheduler_config, num_steps, count, shift)
                    worst = max(worst, _max_diff(sigmas, grid_sigmas), _max_diff(timesteps, grid_timesteps))
                    cases += 1
    MEASURED[f"schedule/{family_name}/{which}"] = worst
    print(f"{family_name} ({which}): {cases} grids, max |difference| {worst:g}")
    assert cases >= len(STEPS) * len(SHIFTS)
    assert worst <= 1e-6


@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_the_scheduler_configs_are_what_the_builds_and_diffusers_hold(family_name: str) -> None:
    """A config read from a file holds the constructor's defaults for what it leaves out (`live_scheduler_config`);
    the tiny builders' `grid_configs` say what their makers build."""
    import importlib

    for which in ("real", "tiny"):
        raw, _, scheduler = _configs(family_name, which)
        live = live_scheduler_config(raw)
        assert live["_class_name"] == type(scheduler).__name__
        for key, value in live.items():
            if key != "_class_name":
                assert scheduler.config[key] == value, (which, key)
    tiny = importlib.import_module(FAMILIES[family_name][1])
    configs = tiny.grid_configs()
    makers = {
        "vae": getattr(tiny, "make_vae", None) or importlib.import_module("miles.builtin.tiny.components").make_vae,
        "transformer": getattr(tiny, "make_transformer", None),
        "transformer_2": getattr(tiny, "make_transformer", None),
    }
    for component, keys in configs.items():
        if component in ("scheduler", "model_index"):
            continue
        maker = makers[component]
        experts = family_name in ("wan2_2", "wan2_2_i2v") and component != "vae"
        built = maker(0, component) if experts else maker(0)
        for key, value in keys.items():
            got = built.config[key]
            assert (list(got) if isinstance(got, (list, tuple)) else got) == value, (component, key)
    if family_name in ("wan2_2", "wan2_2_i2v"):
        assert configs["model_index"]["boundary_ratio"] == tiny.BOUNDARY_RATIO


def _engine_std(sigmas: Any, i: int, sde_type: str, noise_level: float) -> float:
    """The std of step i as the engine's step computes it (`backend_step` with the engine's arguments)."""
    import torch

    from miles.sampling.sde_backends import backend_step

    args = SimpleNamespace(sde_step_backend_path=None, diffusion_log_prob_no_const=False)
    x = torch.zeros(1, 4)
    sigma_max = sigmas[1] if sigmas.shape[0] > 1 else sigmas[0]
    res = backend_step(
        args, x, x, sigmas[i], sigmas[i + 1], sde_type=sde_type, noise_level=noise_level, sigma_max=sigma_max
    )
    return float(res.std)


def _grid_of(family_name: str, which: str, num_steps: int, shift: float | None, size: tuple[int, int]) -> tuple:
    family = get_family(family_name)
    config, components, scheduler = _configs(family_name, which)
    count = family.grid_token_count(components, *size, 1)
    sigmas, timesteps = family.grid_schedule(config, num_steps, count, shift)
    shape = _engine_shape(family, components, *size, 1)
    grid = Grid(
        family_name, "", "", len(timesteps), shift, count, tuple(sigmas), tuple(timesteps), (None,) * num_steps
    )
    return grid, family.schedule(scheduler, num_steps, shape, shift)


@pytest.mark.parametrize(
    "family_name,which,num_steps,shift,size",
    [
        ("wan2_2", "real", 10, None, (480, 832)),
        ("wan2_2", "real", 10, 3.0, (480, 832)),
        ("sd3", "real", 10, None, (512, 512)),
        ("flux", "real", 6, None, (512, 512)),
        ("qwen_image", "real", 10, None, (1024, 1024)),
        ("ltx", "real", 24, None, (512, 768)),
        ("cosmos3", "real", 16, None, (1024, 1024)),  # UniPC's first sigma is 1 - 1e-6, not 1
        ("cosmos3", "tiny", 1, None, (64, 64)),
        ("sd3", "tiny", 1, None, (64, 64)),
    ],
)
def test_the_step_std_is_the_engines(family_name: str, which: str, num_steps: int, shift: Any, size: Any) -> None:
    grid, (sigmas, _) = _grid_of(family_name, which, num_steps, shift, size)
    worst = 0.0
    for sde_type in ("sde", "cps", "ode"):
        for noise_level in (0.0, 0.3, 0.7, 0.9, 1.2):
            for i in range(grid.num_steps):
                want = _engine_std(sigmas, i, sde_type, noise_level)
                got = grid_std(grid, i, sde_type, noise_level)
                worst = max(worst, abs(want - got) / max(1.0, abs(want)))
    MEASURED[f"std/{family_name}/{which}/{num_steps}"] = worst
    print(f"{family_name} ({which}, {num_steps} steps): max relative |std difference| {worst:g}")
    assert worst <= 1e-6


@pytest.mark.parametrize("num_steps", STEPS)
@pytest.mark.parametrize("shift", [None, 3.0, 5.0])
def test_wan_experts_are_the_routing_of_wan_experts(num_steps: int, shift: Any) -> None:
    import torch

    from miles.models.wan2_2.experts import WanExperts, boundary_timestep

    family = get_family("wan2_2")
    config, _, scheduler = _configs("wan2_2", "real")
    folder = shipped_folder(family, FAMILIES["wan2_2"][0])
    index = json.loads((folder / "model_index.json").read_text())
    _, timesteps = family.grid_schedule(config, num_steps, None, shift)
    experts = family.grid_experts(timesteps, index, config)
    sigmas, engine_timesteps = family.schedule(scheduler, num_steps, (16, 1, 60, 104), shift)
    boundary = boundary_timestep(index["boundary_ratio"], config["num_train_timesteps"])
    routed = WanExperts({"transformer": torch.nn.Identity(), "transformer_2": torch.nn.Identity()}, boundary)
    assert experts == [routed.expert_for(t) for t in engine_timesteps.tolist()]
    high = (engine_timesteps >= routed.boundary_timestep).tolist()  # the forward's per-row rule
    assert experts == ["transformer" if h else "transformer_2" for h in high]
    family.bind_checkpoint(folder)
    for expert in ("transformer", "transformer_2"):
        steps = family.trainable_steps(sigmas, engine_timesteps, (expert,))
        assert steps == [i for i, e in enumerate(experts) if e == expert]


def test_wan_experts_per_step_as_families_md_lists_them() -> None:
    """families.md §2: at shift 12, 6 steps HHHHLL, 10 steps HHHHHHLLLL, 20 steps 13H/7L, 40 steps 25H/15L."""
    family = get_family("wan2_2")
    config, _, _ = _configs("wan2_2", "real")
    index = {"boundary_ratio": 0.875}
    for num_steps, high in ((6, 4), (10, 6), (20, 13), (40, 25)):
        experts = family.grid_experts(family.grid_schedule(config, num_steps)[1], index, config)
        assert experts == ["transformer"] * high + ["transformer_2"] * (num_steps - high)
    assert get_family("sd3").grid_experts([1000.0, 500.0], None, {}) == [None, None]


def _rounded(values: Any, digits: int) -> list[float]:
    return [round(float(v), digits) for v in values]


def test_the_grids_families_md_lists() -> None:
    """shared/reference/families.md §4, 10 steps: the wan2_2 grid at shift 12 and its Flow-SDE stds at a = 0.7,
    SD3's at shift 3, cosmos3's at flow_shift 5."""
    wan, _ = _grid_of("wan2_2", "real", 10, None, (480, 832))
    assert _rounded(wan.sigmas, 3) == [1.0, 0.990, 0.977, 0.961, 0.939, 0.908, 0.861, 0.783, 0.624, 0.126, 0.0]
    stds = [grid_std(wan, i, "sde", 0.7) for i in range(10)]
    assert _rounded(stds, 2) == [0.70, 0.78, 0.59, 0.51, 0.48, 0.47, 0.49, 0.53, 0.64, 0.09]
    sd3, _ = _grid_of("sd3", "real", 10, None, (512, 512))
    assert _rounded(sd3.sigmas[:3], 3) == [1.0, 0.960, 0.913]
    assert _rounded(sd3.sigmas[-3:-1], 3) == [0.278, 0.009] and round(sd3.sigmas[-2], 4) == 0.0089
    assert sd3.sigmas[-1] == 0.0
    sd3_stds = [grid_std(sd3, i, "sde", 0.7) for i in range(10)]
    assert _rounded(sd3_stds[:3], 2) == [0.70, 0.74, 0.54] and round(sd3_stds[-1], 3) == 0.006
    cosmos, _ = _grid_of("cosmos3", "real", 10, None, (1024, 1024))
    assert _rounded(cosmos.sigmas[1:3], 3) == [0.978, 0.952] and _rounded(cosmos.sigmas[-3:], 3) == [0.557, 0.359, 0.0]


def test_the_wan_recipe_grid_at_shift_3() -> None:
    """`wan22-pickscore-grpo` at 10 steps and flow shift 3: the SD3 shift-3 grid; steps 0-2 are the high-noise
    expert's, 3-9 the low-noise one's (timestep 857.7 < 875)."""
    from miles.config.resolve import resolve

    args = resolve(
        None, recipe="wan22-pickscore-grpo", cli={"diffusion_num_steps": 10, "diffusion_flow_shift": 3.0}
    ).args
    grid = denoising_grid(args)
    assert grid is not None and grid.family == "wan2_2" and grid.num_steps == 10 and grid.flow_shift == 3.0
    assert "ships" in grid.source
    assert _rounded(grid.sigmas, 4) == [1.0, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.278, 0.0089, 0]
    assert grid.experts == ("transformer",) * 3 + ("transformer_2",) * 7
    rows = grid.rows("sde", 0.9)
    assert [r["index"] for r in rows] == list(range(10)) and rows[0]["std"] == pytest.approx(0.9)
    assert rows[3]["abs_dt"] == pytest.approx(0.8577 - 0.7904, abs=2e-4)


def test_every_shipped_config_folder_has_a_scheduler_and_the_memory_rule_finds_it() -> None:
    from miles.memory.config_dirs import shipped_config_dir

    for family_name, (hub, _) in FAMILIES.items():
        family = get_family(family_name)
        assert shipped_folder(family, hub) == shipped_config_dir(family, hub)


def _args(**overrides: Any) -> SimpleNamespace:
    values = {
        "hf_checkpoint": "tiny-sd3",
        "diffusion_model_family": None,
        "train_pipeline_config_path": None,
        "diffusion_num_steps": 4,
        "diffusion_flow_shift": None,
        "diffusion_height": 64,
        "diffusion_width": 64,
        "diffusion_output_num_frames": 1,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def test_a_local_checkpoint_folder_and_the_reasons_when_there_is_no_grid(tmp_path: Path) -> None:
    folder = tmp_path / "my-flux"
    (folder / "scheduler").mkdir(parents=True)
    (folder / "vae").mkdir()
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True, "shift": 3.0}
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    (folder / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [1, 2, 3, 4]}))
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps({"in_channels": 64}))
    grid = denoising_grid(_args(hf_checkpoint=str(folder), diffusion_model_family="flux", diffusion_height=512))
    assert grid is not None and grid.token_count == (512 // 16) * (64 // 16) and "local checkpoint" in grid.source

    assert "no scheduler config" in grid_unavailable_reason(_args(hf_checkpoint="someone/sd3-finetune"))
    empty = tmp_path / "empty-sd3"
    empty.mkdir()
    assert "has no scheduler" in grid_unavailable_reason(_args(hf_checkpoint=str(empty)))
    refused = grid_unavailable_reason(_args(hf_checkpoint=str(folder), diffusion_model_family="flux"))
    assert refused is None  # 64 x 64: a valid size
    odd = grid_unavailable_reason(_args(hf_checkpoint=str(folder), diffusion_model_family="flux", diffusion_width=72))
    assert "multiples of 16" in odd


class _OwnSchedule(type(get_family("sd3"))):
    def schedule(self, scheduler, num_steps, latent_shape, flow_shift=None):  # type: ignore[override]
        raise AssertionError("not called")


def test_a_family_that_overrides_schedule_alone_has_no_grid() -> None:
    args = _args(train_pipeline_config_path=f"{__name__}._OwnSchedule")
    found = compute_grid(args)
    assert isinstance(found, str) and "overrides `schedule` but not `grid_schedule`" in found


def test_a_recipes_grid_imports_no_torch_nor_diffusers_and_is_quick(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import time
        begin = time.perf_counter()
        import json, sys
        from miles.config.resolve import resolve
        jobs = [resolve(None, recipe=name).args for name in ("wan22-pickscore-grpo", "tiny-digits-grpo")]
        start = time.perf_counter()
        from miles.sampling.grid import denoising_grid
        grids = [denoising_grid(args) for args in jobs]
        end = time.perf_counter()
        print(json.dumps({
            "seconds": end - start,
            "with_resolve": end - begin,
            "heavy": sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules),
            "grids": [None if g is None else [g.family, g.num_steps, g.source] for g in grids],
        }))
        """
    )
    env = {**os.environ, "MILES_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"grid import + two recipes' grids: {report['seconds']:.3f} s ({report['with_resolve']:.3f} s with resolve)")
    assert report["heavy"] == []
    assert [g[:2] for g in report["grids"]] == [["wan2_2", 10], ["sd3", 10]]
    assert report["seconds"] < 0.5 and report["with_resolve"] < 1.0
