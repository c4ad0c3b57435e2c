"""The DMD2 few-step student sampler on a rectified-flow model, with backward simulation (algorithms.md A.7, A.10).

The student runs at the timesteps `--dmd2-student-timesteps` t_0 > t_1 > ... > t_{n-1} (integers in
[0, 999]; the model's timestep input is t_k itself, its sigma is `sigma_k = t_k / 1000`). It predicts a
velocity, and every step re-noises its x0 estimate with fresh Gaussian noise (DMD2's `add_noise`
between steps, not an Euler step); the student uses no CFG::

    x_{t_0}   = eps_0                                          # pure noise
    x0_k      = x_{t_k} - sigma_k * v(x_{t_k}, t_k)
    x_{t_k+1} = (1 - sigma_{k+1}) * x0_k + sigma_{k+1} * eps_{k+1}     # fresh eps every step
    output    = x0_{n-1}

Backward simulation stops at a step k in [0, n-1] (drawn once per iteration, `stop_step`): the
student runs k steps without gradients (exactly k calls, at t_0 .. t_{k-1}) and hands out its state
`x_{t_k}` at `t_k`; one more call gives its x0 at step k, which the trainer recomputes with grad.
With k = 0 the input is pure noise at t_0 (the only input when `--no-dmd2-backward-simulation`).

`velocity_fn(x, t) -> v` takes a `[B, C, h, w]` fp32 batch and a `[B]` fp32 timestep; `noise_fn(shape)`
draws the fresh noise of one step for the whole batch. Pure torch: the engine and tests pass their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NoiseFn = Callable[[torch.Size], torch.Tensor]


def student_sigmas(timesteps: Sequence[int]) -> torch.Tensor:
    """`[n]` fp32 sigmas `t_k / 1000` of the student's timesteps (strictly decreasing, in [0, 999])."""
    ts = [int(t) for t in timesteps]
    if not ts:
        raise ValueError("the student needs at least one timestep")
    if any(not 0 <= t < NUM_TRAIN_TIMESTEPS for t in ts):
        raise ValueError(f"student timesteps must lie in [0, {NUM_TRAIN_TIMESTEPS - 1}], got {ts}")
    if any(a <= b for a, b in itertools.pairwise(ts)):
        raise ValueError(f"student timesteps must be strictly decreasing (noise first), got {ts}")
    return torch.tensor(ts, dtype=torch.float64).div(NUM_TRAIN_TIMESTEPS).to(torch.float32)


def stop_step(seed: int, iteration: int, num_steps: int, backward_simulation: bool = True) -> int:
    """The backward-simulation step k ~ U{0..n-1} of one iteration: a function of (seed, iteration) only,
    so every rank and every process that asks gets the same k. Without backward simulation, k = 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not backward_simulation:
        return 0
    return int(np.random.default_rng([int(seed), 0xD3D2, int(iteration)]).integers(num_steps))


def _t(value: float, batch: int, device: torch.device) -> torch.Tensor:
    return torch.full((batch,), float(value), dtype=torch.float32, device=device)


def x0_at(velocity_fn: VelocityFn, x: torch.Tensor, timestep: int) -> torch.Tensor:
    """The student's x0 estimate `x - sigma * v(x, t)` at one timestep (one call)."""
    sigma = float(timestep) / NUM_TRAIN_TIMESTEPS
    v = velocity_fn(x, _t(timestep, x.shape[0], x.device)).float()
    return x.float() - sigma * v


@dataclass
class SimulationResult:
    """`x_t`: the student's input at step `step` (`[B, C, h, w]`), `timestep`/`sigma` of that step,
    `states`: x_{t_0} .. x_{t_k} (k + 1 tensors)."""

    x_t: torch.Tensor
    step: int
    timestep: int
    sigma: float
    states: list[torch.Tensor]


def backward_simulate(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    timesteps: Sequence[int],
    stop_at: int,
    noise_fn: NoiseFn,
) -> SimulationResult:
    """Run the student `stop_at` steps from `noise` (exactly `stop_at` calls) and return its state at that step."""
    sigmas = student_sigmas(timesteps).tolist()
    n = len(sigmas)
    if not 0 <= stop_at < n:
        raise ValueError(f"stop step {stop_at} is outside [0, {n - 1}] for {n} student timesteps")
    x = noise.float()
    states = [x]
    for k in range(stop_at):
        x0 = x0_at(velocity_fn, x, int(timesteps[k]))
        eps = noise_fn(x.shape).to(x.device, torch.float32)
        x = (1 - sigmas[k + 1]) * x0 + sigmas[k + 1] * eps
        states.append(x)
    return SimulationResult(x, stop_at, int(timesteps[stop_at]), sigmas[stop_at], states)


def few_step_sample(
    velocity_fn: VelocityFn, noise: torch.Tensor, timesteps: Sequence[int], noise_fn: NoiseFn
) -> torch.Tensor:
    """The student's n-step sample from `noise` (n calls): backward simulation to the last step, then its x0."""
    sim = backward_simulate(velocity_fn, noise, timesteps, len(timesteps) - 1, noise_fn)
    return x0_at(velocity_fn, sim.x_t, sim.timestep)
