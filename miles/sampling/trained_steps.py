"""Which denoising steps an RL job trains, read before launch (torch-free): the grid (`miles.sampling.grid`), the steps
the step strategy may draw on it (`miles.sampling.step_strategies.candidate_steps`), confined to the experts that
train, each with its sigma, |dt|, the per-step noise std of `--diffusion-sde-type` and the expert that owns it.

`miles inspect-config` and `miles plan` print it (`plan_lines`); the config rules warn (`grid_warnings`) when
  - an expert of the model that trains (`--update-weight-target-module`) owns none of the candidate steps: it never
    gets a gradient;
  - a candidate step has zero noise (e.g. CPS's last step, sigma_next = 0): its transition is deterministic, there
    is nothing to train on-policy there;
  - step indices (`--diffusion-sde-window-range`, `--diffusion-sde-candidate-steps`) set in one layer (the recipe)
    land on another grid because a later layer (the command line, a YAML) changed the grid under them
    (`--diffusion-num-steps`, `--diffusion-flow-shift`, the checkpoint, the output size): indices mean a noise level
    only on the grid they were chosen on.
Only methods that train on the recorded SDE transitions (`policy_loss`, `custom_loss`) are checked; DiffusionNFT and
DPO re-noise the final sample at fresh noise levels instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.sampling.grid import Grid, compute_grid, step_noise_std
from miles.sampling.step_strategies import Candidates, candidate_steps

# the layers of a job's args, in the order they are laid on (`miles.config.resolve`)
LAYERS = ("default", "recipe", "cli", "yaml")
# flags that move the grid under fixed step indices
GRID_FLAGS = (
    "diffusion_num_steps",
    "diffusion_flow_shift",
    "hf_checkpoint",
    "diffusion_model_family",
    "diffusion_height",
    "diffusion_width",
    "diffusion_output_num_frames",
)
SIGMA_TOLERANCE = 0.01  # a chosen step that moved more than this in sigma is on another grid


@dataclass(frozen=True)
class TrainedSteps:
    """The grid of a job and the steps it may train on it.

    candidates: what the strategy may draw; steps: those the trained experts own (the runtime confines the draw to
    them when only some experts train); trained_experts: the experts that train (empty: one transformer)."""

    grid: Grid
    candidates: Candidates
    steps: tuple[int, ...]
    sde_type: str
    noise_level: float
    trained_experts: tuple[str, ...]

    def std(self, index: int) -> float:
        return step_noise_std(self.grid, index, self.sde_type, self.noise_level)

    def experts_without_steps(self) -> tuple[str, ...]:
        owned = {self.grid.experts[i] for i in self.steps}
        return tuple(e for e in self.trained_experts if e not in owned)

    def zero_noise_steps(self) -> tuple[int, ...]:
        return tuple(i for i in self.steps if not self.std(i) > 0.0)


def trains_sde_steps(args: Any, job: Any) -> bool:
    """The job (its row of the job table, `miles.config.jobs.JobSpec`) trains on recorded SDE transitions: a job
    that trains on rollouts (`train rl`, `replay`) with a method that does."""
    from miles.methods import METHODS

    method = METHODS.get(str(args.loss_type))
    return job.trains_on_rollouts and method is not None and method.on_rollouts and not method.renoises_samples


def _trained_experts(args: Any, grid: Grid) -> tuple[str, ...]:
    from miles.models.pipeline_config import target_components

    experts = tuple(e for e in dict.fromkeys(grid.experts) if e is not None)
    if not experts:
        return ()
    components = target_components(args.update_weight_target_module)
    return tuple(e for e in experts if e in components)


def trained_steps(args: Any, num_steps: int | None = None) -> TrainedSteps | str:
    """The job's grid and candidate steps, or why they cannot be shown (no scheduler config here, a custom step
    strategy). ValueError when the step flags do not fit the grid (or the trained experts' steps): the first rollout
    would raise the same."""
    grid = compute_grid(args, num_steps)
    if isinstance(grid, str):
        return grid
    experts = _trained_experts(args, grid)
    allowed = None
    if experts and set(experts) != {e for e in grid.experts if e is not None}:
        # the runtime confines the draw to the trained experts' steps (the rollout manager's `trained_expert_steps`)
        allowed = [i for i, e in enumerate(grid.experts) if e in experts]
    candidates = candidate_steps(args, grid.num_steps, allowed)
    if candidates is None:
        path = args.diffusion_step_strategy_path
        return f"--diffusion-step-strategy-path {path}: a custom strategy (its steps show in a rollout)"
    steps = tuple(i for i in candidates.steps if 0 <= i < grid.num_steps)
    sde_type, noise_level = str(args.diffusion_sde_type), float(args.diffusion_noise_level)
    return TrainedSteps(grid, candidates, steps, sde_type, noise_level, experts)


# ---- what inspect-config and plan print -------------------------------------------------------------------------
def plan_lines(args: Any, job: Any) -> list[str]:
    """The denoising grid as the job will run it, for `inspect-config` and `plan` (no lines for a job that trains
    no SDE steps)."""
    if not trains_sde_steps(args, job):
        return []
    try:
        found = trained_steps(args)
    except ValueError as exc:
        found = str(exc)
    if isinstance(found, str):
        return [f"denoising grid: not shown ({found})"]
    grid = found.grid
    shift = f", flow shift {grid.flow_shift:g}" if grid.flow_shift is not None else ""
    tokens = f", dynamic shift at {grid.token_count} tokens" if grid.token_count is not None else ""
    lines = [
        f"denoising grid: {grid.num_steps} steps of {grid.family} ({grid.source}{shift}{tokens}); "
        f"--diffusion-sde-type {found.sde_type} at noise level {found.noise_level:g}",
        f"trained steps: {found.candidates.how}",
    ]
    if not found.steps:
        lines.append("trained steps: none on this grid")
        return lines
    header = f"  {'step':>4}  {'sigma':>7}  {'|dt|':>7}  {'timestep':>8}  {'noise std':>9}"
    with_experts = any(e is not None for e in grid.experts)
    lines.append(header + ("  expert" if with_experts else ""))
    for i in found.steps:
        step = grid.steps[i]
        row = f"  {i:>4}  {step.sigma:>7.4f}  {step.abs_dt:>7.4f}  {step.timestep:>8.2f}  {found.std(i):>9.4f}"
        lines.append(row + (f"  {step.expert}" if with_experts else ""))
    return lines


# ---- the config rules' warnings ----------------------------------------------------------------------------------
def grid_warnings(res: Any, job: Any) -> list[str]:
    """One line per problem of the trained steps (see the module docstring); [] when they are sound or unknown.
    ValueError when the step flags do not fit the grid at all (the config rules refuse the job)."""
    args = res.to_args()
    if not trains_sde_steps(args, job) or args.load_debug_rollout_data is not None:
        return []
    found = trained_steps(args)
    if isinstance(found, str):
        return []
    out: list[str] = []
    where = f"{found.grid.num_steps}-step grid"
    for expert in found.experts_without_steps():
        owned = [i for i, e in enumerate(found.grid.experts) if e == expert]
        span = f"steps {owned[0]}-{owned[-1]}" if owned else "no step"
        out.append(
            f"{res.show('update_weight_target_module')} trains {expert}, but none of the candidate SDE steps "
            f"{_steps(found.candidates.steps)} is its own on the {where} (it denoises {span}): {expert} never gets "
            "a gradient; choose steps on both sides of the expert boundary (`miles inspect-config` prints the grid)"
        )
    zero = found.zero_noise_steps()
    if zero:
        out.append(
            f"candidate SDE step{'s' if len(zero) > 1 else ''} {_steps(zero)} of the {where} "
            f"{'have' if len(zero) > 1 else 'has'} zero noise under {res.show('diffusion_sde_type')} at "
            f"{res.show('diffusion_noise_level')}: a deterministic transition, nothing to train on-policy there"
        )
    moved = _moved_indices(res, found)
    if moved:
        out.append(moved)
    return out


def _steps(steps: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(i) for i in steps) if steps else "(none)"


def _moved_indices(res: Any, found: TrainedSteps) -> str | None:
    """The warning when the step indices were set in an earlier layer than a flag that changed the grid."""
    index_flags = [dest for dest in found.candidates.flags if res.explicit(dest)]
    if not index_flags:
        return None
    chosen_in = max(LAYERS.index(res.source(dest)) for dest in index_flags)
    later = [dest for dest in GRID_FLAGS if res.source(dest) in LAYERS and LAYERS.index(res.source(dest)) > chosen_in]
    if not later:
        return None
    layers = LAYERS[: chosen_in + 1]
    args = res.to_args()
    before_args = args.with_values({dest: res.value_at(dest, layers) for dest in GRID_FLAGS}, "derived")
    before = compute_grid(before_args)
    if isinstance(before, str):
        return None
    now, then = found.grid, before
    shifted = [
        i
        for i in found.candidates.steps
        if i >= now.num_steps or i >= then.num_steps or abs(now.sigmas[i] - then.sigmas[i]) > SIGMA_TOLERANCE
    ]
    if not shifted:
        return None
    chosen = " and ".join(res.show(dest) for dest in index_flags)
    changed = ", ".join(res.show(dest) for dest in later)

    def span(grid: Grid) -> str:
        sigmas = [grid.sigmas[i] for i in found.candidates.steps if i < grid.num_steps]
        return f"sigma {max(sigmas):.3f}-{min(sigmas):.3f}" if sigmas else "no step"

    return (
        f"{chosen} were chosen on a {then.num_steps}-step grid ({span(then)}); {changed} changes the grid under them "
        f"(now {span(now)}): step indices mean a noise level only on their own grid, so re-derive them from the grid "
        "`miles inspect-config` prints"
    )
