"""The deterministic steps after a rollout's SDE window (MixGRPO-Flash, algorithms_next.md C.2): the solver
(`--diffusion-ode-solver`) and the compressed schedule (`--diffusion-post-sde-steps-ratio`). Pure torch.

Solvers, for rectified flow (`x_sigma = (1 - sigma) x0 + sigma eps`, velocity `v = eps - x0`):

``euler``      `x' = x + (sigma_next - sigma) v`, the pipelines' own step.

``dpmpp_2m``   DPM-Solver++ 2M (data prediction, midpoint form). With `alpha = 1 - sigma`,
               `lambda = log(alpha / sigma)`, the data prediction `m = x - sigma v` and `h = lambda_t - lambda_s`::

                   first order   x_t = (sigma_t / sigma_s) x_s - alpha_t (e^-h - 1) m_s      (exactly Euler)
                   second order  r0 = (lambda_s - lambda_p) / h,  D1 = (m_s - m_p) / r0
                                 x_t = (sigma_t / sigma_s) x_s - alpha_t (e^-h - 1) (m_s + D1 / 2)

               with `m_p` the data prediction of the step before (at `sigma_p`), whatever that step was (an SDE step
               of the window included, as MixGRPO does), so the first step after the window is already second
               order. The step to `sigma_t = 0` is first order and returns `m_s` (diffusers' `lower_order_final`);
               so is a step whose previous prediction was made at `sigma_p = 1` (`lambda = -inf`).

The compressed schedule keeps the steps up to and including the last SDE step `l` and replaces the `N - l - 1`
steps after it by `n - 1` steps over the same span, `n = max(int((N - l) * ratio), 2)`: the new points sit at
the evenly spaced positions `l + 1 + k (N - l - 1) / (n - 1)`, k = 0..n-1, of the original grid (a position
between two grid points is interpolated linearly, sigmas and timesteps alike). When the spacing is whole, as in
MixGRPO-Flash's recipes (25 steps, window ending at 3, ratio 0.4: positions 4, 7, ..., 25), every point is one
of the original grid's. MixGRPO takes `n = int(max((N - l) * ratio, 1))`: with n = 1 its schedule stops at the
first sigma after the window and never reaches 0 (its trap C.5.2); here n >= 2, so it always ends at sigma = 0.
"""

from __future__ import annotations

import math

import torch

ODE_SOLVERS = ("euler", "dpmpp_2m")


def data_prediction(x: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """`m = x - sigma v`: the clean latent the velocity points at (fp32)."""
    return x.float() - float(sigma) * v.float()


def _lambda(sigma: float) -> float:
    return math.log((1.0 - sigma) / sigma)


def dpmpp_2m_step(
    x: torch.Tensor,
    m: torch.Tensor,
    sigma: float,
    sigma_next: float,
    m_prev: torch.Tensor | None = None,
    sigma_prev: float | None = None,
) -> torch.Tensor:
    """One DPM-Solver++ 2M step from `x` at `sigma` to `sigma_next` with the data prediction `m` (and the previous
    step's `m_prev` at `sigma_prev`, None for a first-order step). fp32."""
    sigma, sigma_next = float(sigma), float(sigma_next)
    if not 0.0 < sigma <= 1.0 or not 0.0 <= sigma_next < sigma:
        raise ValueError(f"dpmpp_2m step needs 1 >= sigma > sigma_next >= 0, got {sigma} -> {sigma_next}")
    x, m = x.float(), m.float()
    if sigma_next == 0.0:
        return m.clone()
    if sigma == 1.0:  # lambda = -inf: the first-order step is Euler, which it equals
        return x + (sigma_next - sigma) * (x - m) / sigma
    alpha_next = 1.0 - sigma_next
    h = _lambda(sigma_next) - _lambda(sigma)
    coef = -alpha_next * math.expm1(-h)  # -alpha_t (e^-h - 1)
    out = (sigma_next / sigma) * x + coef * m
    if m_prev is not None and sigma_prev is not None and sigma_prev < 1.0:
        r0 = (_lambda(sigma) - _lambda(float(sigma_prev))) / h
        out = out + 0.5 * coef * (m - m_prev.float()) / r0
    return out


def post_window_points(num_steps: int, last_sde_step: int, ratio: float) -> list[float]:
    """The fractional positions on the original `num_steps` grid of the compressed schedule's points after the
    last SDE step (see the module docstring); the first is `last_sde_step + 1`, the last `num_steps`."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--diffusion-post-sde-steps-ratio must be in (0, 1], got {ratio}")
    if not 0 <= last_sde_step < num_steps:
        raise ValueError(f"the last SDE step {last_sde_step} is outside [0, {num_steps})")
    start = last_sde_step + 1
    if start == num_steps:
        return [float(num_steps)]
    n = max(int((num_steps - last_sde_step) * ratio), 2)
    span = num_steps - start
    return [start + k * span / (n - 1) for k in range(n)]


def _at(values: torch.Tensor, position: float) -> torch.Tensor:
    lo = math.floor(position)
    frac = position - lo
    if frac == 0.0 or lo + 1 >= values.shape[0]:
        return values[min(lo, values.shape[0] - 1)]
    return values[lo] + frac * (values[lo + 1] - values[lo])


def compress_after(
    sigmas: torch.Tensor, timesteps: torch.Tensor, last_sde_step: int, ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule `(sigmas [T'+1], timesteps [T'])` with the steps after `last_sde_step` compressed (module
    docstring); the steps up to it, and so every SDE step, are the original ones."""
    num_steps = int(timesteps.shape[0])
    points = post_window_points(num_steps, last_sde_step, ratio)
    head = last_sde_step + 1
    # timesteps exist for sigma points 0..N-1; a point at N (sigma 0) has none
    t_ext = torch.cat([timesteps, timesteps[-1:] * 0])
    new_sigmas = torch.stack([*sigmas[:head], *(_at(sigmas, p) for p in points)])
    new_timesteps = torch.stack([*timesteps[:head], *(_at(t_ext, p) for p in points[:-1])])
    return new_sigmas.to(sigmas.dtype), new_timesteps.to(timesteps.dtype)
