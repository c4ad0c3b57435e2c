"""Step strategies: which denoising steps of a sample run stochastically (and become train pairs).

Hook contract (`--diffusion-step-strategy-path`, miles_docs.md §7)::

    def strategy(args, sample, num_steps, seed) -> tuple[list[int] | None, list[int] | None]

returning `(sde_step_indices, return_step_indices)`:
  - `sde_step_indices`: steps i in [0, num_steps) whose transition x_i -> x_{i+1} is sampled with the
    SDE kernel (`--diffusion-sde-type`) and whose log-prob is recorded; every other step runs as an ODE
    (Euler) step. None or [] means an all-ODE trajectory.
  - `return_step_indices`: the latent indices in [0, num_steps] the trainer needs. The stock strategies
    return `S ∪ (S+1)` (the inputs and outputs of the SDE steps); None means no preference (keep all).
    The engine always keeps the final latent anyway, to decode the image.

`args` is any object with the flags as attributes (a missing flag reads as its default); in a rollout it also
carries `rollout_id`, the rollout being sampled (absent elsewhere: read it with `getattr(args, "rollout_id",
None)`). `seed` is the seed the engine passes (a sample's, or under `--diffusion-shared-prefix` its microgroup's,
see `miles.sampling.seeds`): strategies that depend on it are reproducible per seed.

Stock strategies (name them by their bare name or full dotted path):
  - `sde_window`: a random contiguous window of `--diffusion-num-sde-steps` W steps inside
    `--diffusion-sde-window-range lo,hi` (default: all steps); `start = default_rng(seed).integers(lo, hi-W+1)`.
    This is Flow-GRPO-Fast's window, drawn per seed.
  - `epoch_global_random_choice`: k = `--diffusion-num-sde-steps` of `--diffusion-sde-candidate-steps`
    (required), drawn once per epoch (epoch = group_index // rollout_batch_size) with
    `torch.Generator().manual_seed(epoch + rollout_seed)` so every sample of the epoch shares them; all
    candidates when k == 0 or k >= len(candidates).
  - `ode_and_return_last`: no SDE step, only the final latent returned (the NFT-style request).
  - `mix_grpo_window`: MixGRPO's sliding window (algorithms_next.md C.2): W = `--diffusion-num-sde-steps`
    consecutive steps starting at `c = lo + s * (k // tau) mod (the positions of [lo, hi))`, where k is the
    rollout id, tau = `--diffusion-sde-window-interval` rollouts, s = `--diffusion-sde-window-stride` and
    [lo, hi) = `--diffusion-sde-window-range` (default: every step but the last). Every sample of a rollout gets
    the same window; a window that reaches past hi is cut there (MixGRPO's last windows, e.g. [20, 21, 22] of
    [0, 23)), and after the last start in [lo, hi) it rolls back to lo. MixGRPO's own schedule also yields an
    empty window (start = hi) once per cycle, an all-ODE rollout with nothing to train; this one never does.

Default when `--diffusion-step-strategy-path` is unset (`default_steps`), our choice:
  - `--diffusion-num-sde-steps N > 0`: `sde_window` with W = N. It honours `--diffusion-sde-window-range`
    when set (the flag documents itself as the sde_window range); otherwise the window is drawn from
    all steps, so N = num_steps makes every step an SDE step.
  - N == 0 with `--diffusion-sde-type sde|cps` and a non-zero noise level: steps 0 .. T-2, i.e. plain
    Flow-GRPO (its window W = 0 convention, algorithms.md B.8/D.7.2: 9 trained steps of 10). The last
    step stays ODE: its std (about 0.006 at 10 steps) makes the density too sharp to train on.
    (`train rl --loss-type policy_loss` rejects N == 0 without a strategy at parse time, so this case is
    reached by rollout-only and eval jobs.)
  - N == 0 with `--diffusion-sde-type ode` or `--diffusion-noise-level 0`: all steps ODE, `([], None)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.utils.hooks import load_function

StepStrategy = Callable[[Any, Any, int, int], tuple[list[int] | None, list[int] | None]]

STRATEGY_FLAG = "--diffusion-step-strategy-path"


def return_indices(sde_steps: Iterable[int]) -> list[int]:
    """The latent indices `S ∪ (S+1)` that the SDE steps `S` read and write, sorted."""
    steps = set(sde_steps)
    return sorted(steps | {i + 1 for i in steps})


def _window_range(args: Any, num_steps: int) -> tuple[int, int]:
    window_range = args.diffusion_sde_window_range
    if window_range is None:
        return 0, num_steps
    if isinstance(window_range, str):
        window_range = [int(p) for p in window_range.split(",")]
    if len(window_range) != 2:
        raise ValueError(f"--diffusion-sde-window-range must be 'lo,hi', got {window_range!r}")
    return int(window_range[0]), int(window_range[1])


def _sde_window_bounds(args: Any, num_steps: int) -> tuple[int, int, int]:
    """(window, lo, hi) of `sde_window`, checked: ValueError naming the flags when they do not fit the grid."""
    window = int(args.diffusion_num_sde_steps or 0)
    if window <= 0:
        raise ValueError(f"the sde_window strategy needs --diffusion-num-sde-steps > 0 (got {window})")
    lo, hi = _window_range(args, num_steps)
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(
            f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= {num_steps} (the number of steps)"
        )
    if window > hi - lo:
        raise ValueError(
            f"--diffusion-num-sde-steps {window} does not fit the SDE window [{lo}, {hi}) "
            "(--diffusion-sde-window-range)"
        )
    return window, lo, hi


def sde_window(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """A contiguous window of `--diffusion-num-sde-steps` SDE steps at a seed-determined start."""
    window, lo, hi = _sde_window_bounds(args, num_steps)
    start = int(np.random.default_rng(seed).integers(lo, hi - window + 1))
    steps = list(range(start, start + window))
    return steps, return_indices(steps)


def epoch_global_random_choice(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """`--diffusion-num-sde-steps` of the candidate steps, drawn once per epoch and shared by all its samples."""
    candidates = args.diffusion_sde_candidate_steps
    if candidates is None or len(candidates) == 0:
        raise ValueError(
            "the epoch_global_random_choice strategy requires --diffusion-sde-candidate-steps (e.g. '1,2,3')"
        )
    candidates = [int(c) for c in candidates]
    bad = [c for c in candidates if not 0 <= c < num_steps]
    if bad:
        raise ValueError(f"--diffusion-sde-candidate-steps: steps {bad} are outside [0, {num_steps})")
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"--diffusion-sde-candidate-steps has duplicates: {candidates}")
    k = int(args.diffusion_num_sde_steps or 0)
    if k <= 0 or k >= len(candidates):
        steps = sorted(candidates)
    else:
        rollout_batch_size = args.rollout_batch_size
        if not rollout_batch_size:
            raise ValueError("the epoch_global_random_choice strategy needs --rollout-batch-size to find the epoch")
        epoch = int(sample.group_index) // int(rollout_batch_size)
        import torch  # here, so the hub (and what `inspect-config` reads of it) stays torch-free

        generator = torch.Generator().manual_seed(epoch + int(args.rollout_seed))
        perm = torch.randperm(len(candidates), generator=generator)[:k]
        steps = sorted(candidates[i] for i in perm.tolist())
    return steps, return_indices(steps)


def mix_window(rollout_id: int, lo: int, hi: int, window: int, interval: int, stride: int) -> list[int]:
    """MixGRPO's SDE window at rollout `rollout_id` over the steps [lo, hi) (see the module docstring)."""
    if not 0 <= lo < hi or window < 1 or interval < 1 or stride < 1:
        raise ValueError(
            f"a MixGRPO window needs 0 <= lo < hi and W, interval, stride >= 1 "
            f"(got [{lo}, {hi}), W {window}, interval {interval}, stride {stride})"
        )
    positions = -(-(hi - lo) // stride)  # the window starts lo, lo + s, ... below hi
    start = lo + ((rollout_id // interval) % positions) * stride
    return list(range(start, min(start + window, hi)))


def mix_grpo_window(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[list[int], list[int]]:
    """MixGRPO's window, moved every `--diffusion-sde-window-interval` rollouts (the same for every sample)."""
    window = int(args.diffusion_num_sde_steps or 0)
    if window <= 0:
        raise ValueError(f"the mix_grpo_window strategy needs --diffusion-num-sde-steps > 0 (got {window})")
    if args.diffusion_sde_window_range is None:
        lo, hi = 0, num_steps - 1  # never the last step: its density is too sharp to train on
    else:
        lo, hi = _window_range(args, num_steps)
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= {num_steps}")
    rollout_id = getattr(args, "rollout_id", None)
    if rollout_id is None:  # outside a rollout manager: the epoch of the sample's group, as epoch_global_random_choice
        rollout_id = int(sample.group_index) // max(1, int(args.rollout_batch_size or 1))
    interval, stride = int(args.diffusion_sde_window_interval), int(args.diffusion_sde_window_stride)
    steps = mix_window(int(rollout_id), lo, hi, window, interval, stride)
    return steps, return_indices(steps)


def ode_and_return_last(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[None, list[int]]:
    """No SDE step; only the final latent is needed (DiffusionNFT trains from the final image)."""
    return None, [num_steps]


def default_steps(args: Any, sample: Any, num_steps: int, seed: int) -> tuple[list[int], list[int] | None]:
    """The selection used when `--diffusion-step-strategy-path` is unset (see the module docstring)."""
    n = int(args.diffusion_num_sde_steps or 0)
    if n > 0:
        return sde_window(args, sample, num_steps, seed)
    sde_type = args.diffusion_sde_type
    noise_level = float(args.diffusion_noise_level)
    if sde_type == "ode" or noise_level == 0.0:
        return [], None
    steps = list(range(num_steps - 1))
    return steps, return_indices(steps) if steps else None


# ---- what a strategy may draw (torch-free; `miles inspect-config` prints it, the config rules check it) ---------
@dataclass(frozen=True)
class Candidates:
    """The steps a stock strategy may make SDE steps on a `num_steps` grid, and how many it draws."""

    steps: tuple[int, ...]
    how: str  # in words, e.g. "a window of 2 consecutive steps at a per-sample random start in [3, 5)"
    flags: tuple[str, ...]  # the flags (dests) holding step indices: chosen on one grid, they mean nothing on another


def _window_candidates(args: Any, num_steps: int, flags: tuple[str, ...]) -> Candidates:
    window, lo, hi = _sde_window_bounds(args, num_steps)
    if hi - window == lo:  # one possible start
        return Candidates(tuple(range(lo, hi)), f"steps {lo}-{hi - 1}, every sample", flags)
    shared = bool(args.diffusion_shared_prefix) or args.diffusion_post_sde_steps_ratio is not None
    per = "microgroup's" if shared else "sample's"
    how = f"a window of {window} consecutive steps at each {per} random start in [{lo}, {hi - window}]"
    return Candidates(tuple(range(lo, hi)), how, flags)


def _mix_candidates(args: Any, num_steps: int, flags: tuple[str, ...]) -> Candidates:
    """Every window MixGRPO's schedule reaches (it repeats after positions x interval rollouts), as drawn."""
    window = int(args.diffusion_num_sde_steps or 0)
    if args.diffusion_sde_window_range is None:
        lo, hi = 0, num_steps - 1
    else:
        lo, hi = _window_range(args, num_steps)
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= {num_steps}")
    interval, stride = int(args.diffusion_sde_window_interval), int(args.diffusion_sde_window_stride)
    positions = -(-(hi - lo) // max(stride, 1))
    steps: set[int] = set()
    for rollout_id in range(positions * max(interval, 1)):
        steps.update(mix_window(rollout_id, lo, hi, window, interval, stride))
    every = f", start every {stride} steps" if stride > 1 else ""
    how = f"MixGRPO's window of {window} steps sliding through [{lo}, {hi}){every}, moved every {interval} rollouts"
    return Candidates(tuple(sorted(steps)), how, flags)


def candidate_steps(args: Any, num_steps: int, allowed: list[int] | None = None) -> Candidates | None:
    """What the strategy `--diffusion-step-strategy-path` may draw on a `num_steps` grid (None: a custom strategy,
    whose draws only a rollout shows), confined to the steps `allowed` (the experts that train) exactly as
    `select_steps` confines a rollout's draw. ValueError (the strategy's own message) when the flags do not fit:
    the rollout would raise it."""
    path = args.diffusion_step_strategy_path
    name = str(path).strip().rpartition(".")[2] if path else "default_steps"
    if path and str(path).strip() not in STOCK_STRATEGIES and not str(path).startswith(__name__ + "."):
        return None
    window_flags = ("diffusion_sde_window_range",) if args.diffusion_sde_window_range is not None else ()
    view = args
    if allowed is not None:
        if not allowed:
            raise ValueError("the trained experts make none of the denoising steps (--update-weight-target-module)")
        view = _Confined(args, allowed, num_steps)
    if name == "sde_window" or (name == "default_steps" and int(args.diffusion_num_sde_steps or 0) > 0):
        return _window_candidates(view, num_steps, window_flags)
    if name == "epoch_global_random_choice":
        given = view.diffusion_sde_candidate_steps
        if not given:
            raise ValueError(
                "the epoch_global_random_choice strategy requires --diffusion-sde-candidate-steps (e.g. '1,2,3')"
                + (" among the trained experts' steps" if allowed is not None else "")
            )
        steps = tuple(sorted(int(c) for c in given))
        k = int(args.diffusion_num_sde_steps or 0)
        listed = ",".join(str(s) for s in steps)
        how = (
            f"steps {listed}, every sample"
            if k <= 0 or k >= len(steps)
            else f"{k} of steps {listed}, drawn once per epoch and shared by its samples"
        )
        return Candidates(steps, how, ("diffusion_sde_candidate_steps",))
    if name == "ode_and_return_last":
        return Candidates((), "no SDE step (the final latent only)", ())
    if name == "mix_grpo_window":
        return _mix_candidates(view, num_steps, window_flags)
    if name == "default_steps":
        if args.diffusion_sde_type == "ode" or float(args.diffusion_noise_level) == 0.0:
            return Candidates((), "no SDE step (ODE rollouts)", ())
        steps = tuple(i for i in range(num_steps - 1) if allowed is None or i in allowed)
        return Candidates(steps, "every step but the last (plain Flow-GRPO)", ())
    return None


STOCK_STRATEGIES: dict[str, StepStrategy] = {
    "sde_window": sde_window,
    "epoch_global_random_choice": epoch_global_random_choice,
    "ode_and_return_last": ode_and_return_last,
    "mix_grpo_window": mix_grpo_window,
    "default_steps": default_steps,
}


def resolve_step_strategy(args: Any) -> StepStrategy:
    """The strategy named by `args.diffusion_step_strategy_path`: a stock name, a dotted path, or the default."""
    path = args.diffusion_step_strategy_path
    if not path:
        return default_steps
    if callable(path):
        return path
    path = str(path).strip()
    fn = STOCK_STRATEGIES.get(path)
    if fn is None:
        fn = load_function(path, STRATEGY_FLAG)
    if not callable(fn):
        raise TypeError(f"{STRATEGY_FLAG} {path!r} is not callable")
    return fn


def _check_indices(values: Any, upper: int, what: str, name: str) -> list[int]:
    out = sorted({int(i) for i in values})
    bad = [i for i in out if not 0 <= i <= upper]
    if bad:
        raise ValueError(f"step strategy {name} returned {what} {bad} outside [0, {upper}]")
    return out


class _Confined:
    """`args` seen by a strategy confined to the steps `allowed` (a contiguous range): the SDE window range is
    intersected with it and the candidate steps are filtered to it."""

    def __init__(self, args: Any, allowed: list[int], num_steps: int) -> None:
        self._args = args
        lo, hi = _window_range(args, num_steps)
        lo, hi = max(lo, allowed[0]), min(hi, allowed[-1] + 1)
        if lo >= hi:
            raise ValueError(
                f"--diffusion-sde-window-range {_window_range(args, num_steps)} holds none of the trained "
                f"experts' steps {allowed[0]}..{allowed[-1]} (--update-weight-target-module)"
            )
        self.diffusion_sde_window_range = [lo, hi]
        candidates = args.diffusion_sde_candidate_steps
        if candidates:
            self.diffusion_sde_candidate_steps = [int(c) for c in candidates if int(c) in allowed] or None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


class _InRollout:
    """`args` seen by a strategy during rollout `rollout_id` (`args.rollout_id`)."""

    def __init__(self, args: Any, rollout_id: int) -> None:
        self._args = args
        self.rollout_id = rollout_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def select_steps(
    args: Any,
    sample: Any,
    num_steps: int,
    seed: int,
    strategy: StepStrategy | None = None,
    allowed: list[int] | None = None,
    rollout_id: int | None = None,
) -> tuple[list[int], list[int] | None]:
    """Run the strategy (resolved from `args` unless given) and normalize its answer for the engine.

    Returns `(sde_steps, return_steps)`: sorted, de-duplicated, range-checked; `sde_steps` is a list
    (possibly empty), `return_steps` stays None when the strategy has no preference. `allowed` (a
    contiguous run of steps: those of the experts that train, `TrainPipelineConfig.trainable_steps`)
    confines the draw: the strategy sees the window range and candidates cut to it, the default's
    every-step selection keeps only those, and any other step it returns is an error.
    """
    fn = strategy or resolve_step_strategy(args)
    name = getattr(fn, "__qualname__", repr(fn))
    if rollout_id is not None:
        args = _InRollout(args, rollout_id)
    if allowed is not None:
        if not allowed:
            raise ValueError("the trained experts make none of the denoising steps (--update-weight-target-module)")
        args = _Confined(args, allowed, num_steps)
    result = fn(args, sample, num_steps, seed)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"step strategy {name} must return (sde_step_indices, return_step_indices), got {result!r}")
    sde_steps, return_steps = result
    sde = [] if sde_steps is None else _check_indices(sde_steps, num_steps - 1, "SDE steps", name)
    ret = None if return_steps is None else _check_indices(return_steps, num_steps, "return steps", name)
    if allowed is not None:
        if fn is default_steps:
            sde = [i for i in sde if i in allowed]
            ret = return_indices(sde) if ret is not None else None
        outside = [i for i in sde if i not in allowed]
        if outside:
            raise ValueError(
                f"step strategy {name} chose SDE steps {outside}, which the experts that train do not make "
                f"(their steps: {allowed[0]}..{allowed[-1]}; --update-weight-target-module)"
            )
    return sde, ret
