"""The denoising grid of a job without torch or diffusers: what `miles inspect-config` and `miles plan` print.

`denoising_grid(args)` gives, for the resolved args of a job, the grid the engines step on: each step's sigma,
next sigma, |dt|, timestep and (for a family with experts, wan2_2) the expert that denoises it, equal to what
`TrainPipelineConfig.schedule` computes with the diffusers scheduler at run time (the family's `grid_schedule` is
the same arithmetic in numpy). `step_noise_std(grid, i, sde_type, noise_level)` is the std of step i's Gaussian
transition as `miles.sampling.sde.sde_step` computes it inside the in-process engine (the built-in step backends).

Where the scheduler config comes from, first hit wins (none of them is downloaded):
  1. `--hf-checkpoint` as a local folder (a built-in name: its build under `$MILES_HOME`, once built),
  2. a built-in tiny model not built yet: its builder's `grid_configs()` (an SFT start point: its base's),
  3. a hub id in the local Hugging Face cache,
  4. the configs miles ships for the checkpoint (`miles/models/<family>/real_config/<name>/`, as
     `miles.memory.config_dirs.shipped_config_dir` finds them).
Otherwise there is no grid; `grid_unavailable_reason(args)` says why.

Torch-free: numpy and the family registry only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
MODEL_INDEX = "model_index.json"
REAL_CONFIG = "real_config"
SDE_TYPES = ("sde", "cps", "ode")


@dataclass(frozen=True)
class GridStep:
    """One denoising step: from `sigma` to `sigma_next` at the model's `timestep`; `expert` is the component that
    denoises it (None: the family has one transformer)."""

    index: int
    sigma: float
    sigma_next: float
    abs_dt: float
    timestep: float
    expert: str | None


@dataclass(frozen=True)
class Grid:
    """A job's denoising grid: `sigmas` [T+1] (ending in 0) and `timesteps` [T], the fp32 values as floats.

    family / checkpoint: what the grid is for; source: where its scheduler config was read; token_count: the
    image token count a dynamic shift used (None: the shift is static); flow_shift: `--diffusion-flow-shift`.
    """

    family: str
    checkpoint: str
    source: str
    num_steps: int
    flow_shift: float | None
    token_count: int | None
    sigmas: tuple[float, ...]
    timesteps: tuple[float, ...]
    experts: tuple[str | None, ...]

    @property
    def sigma_max(self) -> float:
        """What the engine passes as `sigma_max` to every step: `sigmas[1]` (the `sde` step's guard)."""
        return self.sigmas[1] if len(self.sigmas) > 1 else self.sigmas[0]

    @property
    def steps(self) -> tuple[GridStep, ...]:
        import numpy as np

        out = []
        for i, (t, expert) in enumerate(zip(self.timesteps, self.experts, strict=True)):
            sigma, nxt = self.sigmas[i], self.sigmas[i + 1]
            out.append(GridStep(i, sigma, nxt, float(abs(np.float32(nxt) - np.float32(sigma))), t, expert))
        return tuple(out)

    def rows(self, sde_type: str, noise_level: float) -> list[dict[str, Any]]:
        """JSON-friendly rows: each step's fields and `std`, `step_noise_std` at `sde_type` / `noise_level`."""
        return [
            {**step.__dict__, "std": step_noise_std(self, step.index, sde_type, noise_level)} for step in self.steps
        ]


def step_noise_std(grid: Grid, index: int, sde_type: str, noise_level: float) -> float:
    """The std of step `index`'s transition, as the in-process engine's step (`sde_step` through the built-in backend,
    in fp32) computes it: the engine passes `sigmas[i]`, `sigmas[i + 1]` and `sigma_max = sigmas[1]`.

    `sde`: a * sqrt(sigma * (-dt) / (1 - sigma*)), sigma* = sigma_max where sigma > sigma_max (the first step:
    exactly `a` there when sigma is 1), else sigma;
    `cps`: sigma_next * sin(a * pi / 2); `ode`, or a noise level <= 0 (the engine then steps by ODE): 0.
    A `--sde-step-backend-path` backend computes its own (not known here).
    """
    import numpy as np

    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    if not 0 <= index < grid.num_steps:
        raise IndexError(f"step {index} of a {grid.num_steps}-step grid")
    a = float(noise_level)
    if sde_type == "ode" or not a > 0:
        return 0.0
    f32 = np.float32
    sigma, nxt = f32(grid.sigmas[index]), f32(grid.sigmas[index + 1])
    with np.errstate(divide="ignore", invalid="ignore"):
        if sde_type == "sde":
            top = f32(grid.sigma_max)
            guard = top if sigma > top else sigma
            std = f32(a) * np.sqrt(sigma * (-(nxt - sigma)) / (f32(1) - guard))
        else:
            std = nxt * np.sin(f32(a) * f32(math.pi / 2))
    return float(std)


# ---- the grid of a job ----------------------------------------------------------------------------------------
def denoising_grid(args: Any, num_steps: int | None = None) -> Grid | None:
    """The grid the engines step on for `args` (a resolved job's args) at `num_steps` (default
    `--diffusion-num-steps`; evaluation runs `--diffusion-eval-num-steps`), or None where it cannot be computed
    without the model (`grid_unavailable_reason` says why)."""
    found = compute_grid(args, num_steps)
    return found if isinstance(found, Grid) else None


def grid_unavailable_reason(args: Any, num_steps: int | None = None) -> str | None:
    """Why `denoising_grid(args, num_steps)` is None (one line), else None."""
    found = compute_grid(args, num_steps)
    return found if isinstance(found, str) else None


def compute_grid(args: Any, num_steps: int | None = None) -> Grid | str:
    """The grid, or the reason there is none (what `denoising_grid` and `grid_unavailable_reason` read)."""
    from miles.core.errors import ConfigError
    from miles.models.families import resolve_family

    checkpoint = args.hf_checkpoint
    try:
        family = resolve_family(
            checkpoint,
            family=args.diffusion_model_family,
            config_path=args.train_pipeline_config_path,
            require_trainable=False,
        )
    except ConfigError as exc:
        return f"no model family: {exc}"
    stale = _schedule_without_grid(family)
    if stale:
        return stale
    steps = int(num_steps if num_steps is not None else args.diffusion_num_steps)
    if steps < 1:
        return f"{steps} denoising steps: a grid needs at least one"
    found = checkpoint_configs(family, str(checkpoint))
    if isinstance(found, str):
        return found
    flow_shift = None if args.diffusion_flow_shift is None else float(args.diffusion_flow_shift)
    height, width = int(args.diffusion_height), int(args.diffusion_width)
    frames = int(args.diffusion_output_num_frames or 1)
    counted: list[int] = []

    def token_count() -> int:
        counted.append(int(family.grid_token_count(found.components(), height, width, frames)))
        return counted[-1]

    try:
        sigmas, timesteps = family.grid_schedule(
            found.scheduler, steps, token_count=token_count, flow_shift=flow_shift
        )
        experts = family.grid_experts(timesteps, found.model_index, found.scheduler)
    except (ValueError, KeyError, TypeError) as exc:
        return f"model family {family.name!r} ({found.source}): {exc}"
    return Grid(
        family=family.name,
        checkpoint=str(checkpoint),
        source=found.source,
        num_steps=len(timesteps),
        flow_shift=flow_shift,
        token_count=counted[-1] if counted else None,
        sigmas=tuple(float(s) for s in sigmas),
        timesteps=tuple(float(t) for t in timesteps),
        experts=tuple(experts),
    )


def _defined_by(cls: type, name: str) -> type:
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def _schedule_without_grid(family: Any) -> str:
    """A family class that overrides `schedule` below the class its `grid_schedule` comes from: the torch-free grid
    would not be its schedule."""
    cls = type(family)
    schedule, grid = _defined_by(cls, "schedule"), _defined_by(cls, "grid_schedule")
    if schedule is not grid and issubclass(schedule, grid):
        return (
            f"model family {family.name!r}: {schedule.__qualname__} overrides `schedule` but not `grid_schedule`, "
            "so its grid is known only with the model loaded"
        )
    return ""


# ---- where the configs are -------------------------------------------------------------------------------------
@dataclass
class CheckpointConfigs:
    """A checkpoint's scheduler config, its model_index.json (None: not there) and, on demand, its component configs
    (`components()`: {component: config.json}, for the token count of a dynamic shift)."""

    source: str
    scheduler: dict[str, Any]
    model_index: dict[str, Any] | None
    read_components: Callable[[], dict[str, dict[str, Any]]]

    def components(self) -> dict[str, dict[str, Any]]:
        return self.read_components()


def checkpoint_configs(family: Any, checkpoint: str) -> CheckpointConfigs | str:
    """The configs of `checkpoint` (see the module docstring for the order), or why there are none."""
    from miles.builtin.names import builtin_path, is_builtin_model

    text = os.fspath(checkpoint)
    builtin = is_builtin_model(text)
    local = builtin_path(text) if builtin else Path(os.path.expanduser(text))
    if local is not None and local.is_dir():
        if (local / SCHEDULER_CONFIG).is_file():
            what = f"built-in {text} at {local}" if builtin else f"the local checkpoint {local}"
            return _folder_configs(local, what)
        if not builtin:
            return f"the local checkpoint {local} has no {SCHEDULER_CONFIG}"
    if builtin:
        return _tiny_configs(text)
    hub = _hub_cache_folder(text)
    if hub is not None:
        return _folder_configs(hub, f"{text} in the Hugging Face cache")
    shipped = shipped_folder(family, text)
    if shipped is not None:
        return _folder_configs(shipped, f"the configs miles ships for {text}")
    return (
        f"no scheduler config for {text}: not a local checkpoint, not in the Hugging Face cache, and miles ships no "
        f"configs for it (miles/models/<family>/{REAL_CONFIG}/)"
    )


def shipped_folder(family: Any, checkpoint: str) -> Path | None:
    """The family's shipped configs for `checkpoint` that hold a scheduler config: `real_config/<its last path
    component>` next to the family's module (the rule of `miles.memory.config_dirs.shipped_config_dir`)."""
    name = str(checkpoint).rstrip("/\\").replace("\\", "/").rpartition("/")[2]
    if not name:
        return None
    package = type(family).__module__.rpartition(".")[0]
    try:
        spec = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / REAL_CONFIG / name
    return folder if (folder / MODEL_INDEX).is_file() and (folder / SCHEDULER_CONFIG).is_file() else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


STAND_IN = "_miles_stand_in"  # a shipped scheduler config that is not the checkpoint's own: why, in words


def _folder_configs(folder: Path, source: str) -> CheckpointConfigs | str:
    scheduler = _read_json(folder / SCHEDULER_CONFIG)
    if scheduler is None:
        return f"{source}: {folder / SCHEDULER_CONFIG} is not a JSON object"
    stand_in = scheduler.pop(STAND_IN, None)
    if stand_in:
        source = f"{source}; STAND-IN scheduler: {stand_in}"

    def components() -> dict[str, dict[str, Any]]:
        out = {}
        for entry in sorted(folder.iterdir()):
            config = _read_json(entry / "config.json") if entry.is_dir() else None
            if config is not None:
                out[entry.name] = config
        return out

    return CheckpointConfigs(source, scheduler, _read_json(folder / MODEL_INDEX), components)


def _hub_cache_folder(text: str) -> Path | None:
    from miles.models.hub_cache import cached_snapshot, looks_like_hub_id

    if not looks_like_hub_id(text):
        return None
    return cached_snapshot(text, lambda path: (path / SCHEDULER_CONFIG).is_file())


def tiny_base(name: str) -> str | None:
    """The tiny build a built-in model name is (`tiny-sd3`) or starts from (`tiny-sd3-digits-sft-short`)."""
    from miles.builtin.names import TINY_BUILDERS

    if name in TINY_BUILDERS:
        return name
    bases = [base for base in TINY_BUILDERS if name.startswith(base + "-")]
    return max(bases, key=len) if bases else None


def _tiny_configs(name: str) -> CheckpointConfigs | str:
    from miles.builtin.names import TINY_BUILDERS

    base = tiny_base(name)
    if base is None:
        return f"built-in {name}: not built yet, and no tiny build it starts from"
    module_name = TINY_BUILDERS[base].partition(":")[0]
    configs: Mapping[str, Any] = getattr(importlib.import_module(module_name), "grid_configs", lambda: {})()
    if "scheduler" not in configs:
        return f"built-in {name}: not built yet, and {module_name} has no grid_configs() with its scheduler"
    parts = {k: dict(v) for k, v in configs.items()}
    index = parts.pop("model_index", None)
    scheduler = parts.pop("scheduler")
    return CheckpointConfigs(
        f"built-in {name} (not built yet: {module_name}.grid_configs)", scheduler, index, lambda: parts
    )


def format_grid(grid: Grid, sde_type: str, noise_level: float) -> list[str]:
    """The grid as text lines (a header, then one line per step), with each step's std at `sde_type`/`noise_level`."""
    shift = f", flow shift {grid.flow_shift:g}" if grid.flow_shift is not None else ""
    tokens = f", {grid.token_count} image tokens" if grid.token_count is not None else ""
    lines = [
        f"denoising grid: {grid.num_steps} steps of {grid.family} ({grid.source}){shift}{tokens}; "
        f"std: {sde_type} at noise level {noise_level:g}",
        f"{'step':>4} {'sigma':>9} {'sigma_next':>10} {'|dt|':>9} {'timestep':>9} {'std':>9}"
        + (" expert" if any(grid.experts) else ""),
    ]
    for row in grid.rows(sde_type, noise_level):
        expert = f" {row['expert']}" if row["expert"] else ""
        lines.append(
            f"{row['index']:>4} {row['sigma']:>9.4f} {row['sigma_next']:>10.4f} {row['abs_dt']:>9.4f} "
            f"{row['timestep']:>9.2f} {row['std']:>9.4f}{expert}"
        )
    return lines
