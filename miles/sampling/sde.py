"""The denoising-step math shared by the rollout engines and the trainer: pure torch, no Ray, no diffusers.

One function, `sde_step`, both samples a transition (rollout) and re-scores a stored one (trainer
recompute), so the two sides cannot drift apart. All arithmetic runs in fp32: every tensor input is
cast with `.float()` (fp16/bf16 are promoted, fp64 is demoted) and every output is fp32.

Notation (rectified flow, SD3): `x_sigma = (1 - sigma) * x0 + sigma * eps`, the model predicts the
velocity `v = eps - x0`, sampling runs from sigma = 1 (noise) to sigma = 0 (data) over a schedule
`sigmas[0..T]` with a terminal 0, and `dt = sigma_next - sigma < 0`.

Step types (`sde_type`):

``sde`` (Flow-GRPO's Flow-SDE, algorithms.md B.2)::

    sigma*    = sigma_max if sigma > sigma_max else sigma   # guard; the caller passes sigma_max = sigmas[1]
    std_dev_t = a * sqrt(sigma / (1 - sigma*))              # a = noise_level (eta)
    mean      = x * (1 + std_dev_t**2 / (2 sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 sigma)) * dt
    s         = std_dev_t * sqrt(-dt)                       # the per-step std
    x'        = mean + s * xi,  xi ~ N(0, I)
    log_prob  = mean_{non-batch}( -(x' - mean)**2 / (2 s**2) - log s - log sqrt(2 pi) )

  `s` is evaluated as `a * sqrt(sigma * (-dt) / (1 - sigma*))`, the same value in exact arithmetic,
  written so that at sigma = 1 (with sigma_max = sigmas[1]) it is *exactly* `a` in fp32. Flow-GRPO guards
  `sigma == 1`; on its grids (which start at exactly 1) that is the first step, the only one above sigmas[1], so
  `sigma > sigma_max` is the same guard there. It also holds on a grid whose first sigma misses 1 by rounding
  (UniPC's flow sigmas, cosmos3: 0.999999): `1 - sigma` = 1e-6 would otherwise make the first step's std ~100.

``cps`` (Coefficients-Preserving Sampling, arXiv 2509.05952, algorithms.md B.8)::

    std      = sigma_next * sin(a * pi / 2)
    x0_hat   = x - sigma * v ;  x1_hat = x + (1 - sigma) * v
    mean     = (1 - sigma_next) * x0_hat + sqrt(max(sigma_next**2 - std**2, 0)) * x1_hat
    x'       = mean + std * xi
    log_prob = -mean_{non-batch}((x' - mean)**2)             # every constant dropped, 1/(2 std**2) included

  (The clamp is at 0, not 1e-12: with a = 0 the step is then the Euler step up to rounding, also on the
  last step where sigma_next = 0.) For families whose CPS sigma is `timestep / divisor`, the caller
  passes those sigmas; this module does not care where they came from.

``ode`` (deterministic Euler step, NFT rollouts and evaluation)::

    x' = mean = x + v * dt,  std = 0,  log_prob = None

A zero scalar `noise_level` makes `sde` and `cps` deterministic too: `x'` is the mean, no noise is
drawn and `log_prob` is None (a step without noise has no density; for `sde` the mean is then
bit-identical to the Euler step). A per-batch `noise_level` tensor containing zeros is computed
row-wise as written; the log-prob of such a row is not meaningful (nan for `sde`), mask it.

Log-probs are *averaged* (not summed) over the non-batch dimensions, one number per sample, as
Flow-GRPO does; the clip range and KL coefficient are tuned to that convention.

Shapes: `x` and `v` are `[B, ...]` (dim 0 is the batch; a 1-D `x` is B scalar samples). `sigma`,
`sigma_next`, `sigma_max` and `noise_level` are each a Python number, a 0-d tensor or a per-batch
tensor `[B]`. `StepResult.std`/`std_dev_t` come back 0-d when all of those are scalars, else `[B]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SDE_TYPES = ("sde", "cps", "ode")

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

Scalar = float | int | torch.Tensor
GeneratorArg = torch.Generator | Sequence[torch.Generator] | None


# --------------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------------


def shift_sigmas(sigmas: torch.Tensor | np.ndarray | float, shift: float):
    """The static SD3 timestep shift `shift * s / (1 + (shift - 1) * s)` (works on floats, arrays, tensors)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sd3_sigmas(num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The SD3 flow-matching sigma schedule, `[num_steps + 1]` fp32 with a terminal 0.

    Reproduces `FlowMatchEulerDiscreteScheduler(shift=shift, num_train_timesteps=N).set_timesteps(num_steps)`
    (static shift; no dynamic shifting, Karras/exponential/beta sigmas or terminal stretch) bit for bit,
    including its arithmetic: the scheduler's constructor computes `sigma_min = shift(1 / N)` in fp32,
    `set_timesteps` takes a float64 `linspace(N * sigma_max, N * sigma_min, num_steps)`, divides by N,
    shifts a second time in float64 and casts to fp32. Because of that double shift the last non-zero
    sigma is 0.00893 (not 0.003) for 10 steps at shift 3.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    n = num_train_timesteps
    # The constructor: fp32 train timesteps n..1, sigmas = t / n, shifted in fp32.
    ends = torch.tensor([float(n), 1.0], dtype=torch.float32) / n
    ends = shift * ends / (1 + (shift - 1) * ends)
    sigma_max, sigma_min = ends[0].item(), ends[1].item()
    timesteps = np.linspace(sigma_max * n, sigma_min * n, num_steps)
    sigmas = timesteps / n
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    sigmas = torch.from_numpy(sigmas).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def sigmas_to_timesteps(sigmas: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The model's timestep input per step, `[T]` fp32: `sigmas[:-1] * N`, as the scheduler computes it."""
    return sigmas[:-1].to(torch.float32) * num_train_timesteps


# --------------------------------------------------------------------------------------------------
# Step
# --------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One denoising transition x -> prev_sample (diffusers calls the next latent `prev_sample`).

    prev_sample  the next latent x' (sampled, or the one passed in for a recompute), fp32 `[B, ...]`
    mean         the transition mean, fp32 `[B, ...]` (carries the graph of `v` when it requires grad)
    std          the per-step std s of x' (0 for ode), 0-d or `[B]`
    std_dev_t    the SDE diffusion coefficient before the sqrt(-dt) factor (sde); equal to `std` for cps;
                 0 for ode. The trainer's KL term divides by its square.
    log_prob     per-sample log-density of prev_sample, mean over non-batch dims, `[B]`; None for ode and
                 for a zero scalar noise level
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_dev_t: torch.Tensor
    log_prob: torch.Tensor | None


def _per_batch(value: Scalar, name: str, device: torch.device, batch: int) -> torch.Tensor:
    """A scalar or `[B]` fp32 tensor on `device`."""
    t = torch.as_tensor(value, dtype=torch.float32).to(device=device, dtype=torch.float32)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and t.shape[0] == batch:
        return t
    raise ValueError(f"{name} must be a number, a 0-d tensor or a per-batch tensor [{batch}], got {tuple(t.shape)}")


def _view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Reshape a 0-d or `[B]` tensor to broadcast against a `[B, ...]` tensor of `ndim` dims."""
    return t if t.ndim == 0 else t.reshape(-1, *([1] * (ndim - 1)))


def _mean_non_batch(t: torch.Tensor) -> torch.Tensor:
    # torch.mean(dim=()) would reduce everything: a 1-D tensor is already one value per sample.
    return t if t.ndim <= 1 else t.mean(dim=tuple(range(1, t.ndim)))


def _masked_mean(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of each row of `t` [B, ...] over the elements where `mask` (one row's shape) is True."""
    keep = mask.to(t.device).expand(t.shape[1:]).reshape(-1)
    return t.reshape(t.shape[0], -1)[:, keep].mean(dim=1)


def _is_zero_scalar(value: Scalar) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and float(value) == 0.0
    return float(value) == 0.0


def draw_noise(
    shape: Sequence[int], generator: GeneratorArg = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Standard normal fp32 noise of `shape` on `device`.

    `generator` is None (torch's global RNG), one `torch.Generator` (draws the whole batch on the
    generator's device), or one generator per batch row (each row drawn separately with shape
    `shape[1:]`, so a sample's noise does not depend on what it is batched with).
    """
    shape = tuple(shape)
    if generator is None:
        return torch.randn(shape, dtype=torch.float32, device=device)
    if isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator.device).to(device)
    generators = list(generator)
    if len(generators) != shape[0]:
        raise ValueError(f"got {len(generators)} generators for a batch of {shape[0]}")
    rows = [torch.randn(shape[1:], generator=g, dtype=torch.float32, device=g.device).to(device) for g in generators]
    return torch.stack(rows)


def step_log_prob(
    x_next: torch.Tensor,
    mean: torch.Tensor,
    std: Scalar,
    sde_type: str,
    no_const: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample log-prob `[B]` of `x_next` under the step's Gaussian, averaged over non-batch dims.

    `sde`: the full Gaussian log-density with std `std` (0-d or `[B]`); with `no_const`
    (`--diffusion-log-prob-no-const`) the terms that do not depend on the mean, `-log s - log sqrt(2 pi)`,
    are dropped. `cps`: `-mean((x_next - mean)**2)`, every constant already dropped (`std` and `no_const`
    unused). `ode` has no density and raises. Nothing is detached here: `sde_step` detaches the sample it scores.
    `mask` (bool, one sample's shape): average over the True elements only (`sde_step`'s `mask`).
    """
    x_next = x_next.float()
    mean = mean.float()
    diff_sq = (x_next - mean) ** 2
    reduce = _mean_non_batch if mask is None else (lambda t: _masked_mean(t, mask))
    if sde_type == "cps":
        return -reduce(diff_sq)
    if sde_type == "sde":
        s = _view(torch.as_tensor(std, dtype=torch.float32).to(device=mean.device, dtype=torch.float32), mean.ndim)
        if no_const:
            return reduce(-diff_sq / (2 * s**2))
        return reduce(-diff_sq / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI)
    if sde_type == "ode":
        raise ValueError("an ode step is deterministic and has no log-prob")
    raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    sde_type: str,
    noise_level: Scalar,
    sigma_max: Scalar | None = None,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: GeneratorArg = None,
    no_const: bool = False,
    mask: torch.Tensor | None = None,
) -> StepResult:
    """One denoising step from `x` at `sigma` to `sigma_next` with model velocity `v` (after CFG).

    Rollout: leave `prev_sample` None; the next latent is `mean + std * noise`, with `noise` given or drawn
    from `generator` (see `draw_noise`). Trainer recompute: pass the stored next latent as `prev_sample`;
    it is returned unchanged and its log-prob computed (detached, so gradients flow through `mean` only).
    `sigma_max` is the schedule's `sigmas[1]`, used by `sde` in place of sigma where sigma > sigma_max (the first
    step); it is required for `sde` whenever a sigma equals 1. `no_const` drops the log-prob's constant terms
    (`step_log_prob`). See the module docstring for the formulas.

    `mask` (a bool tensor of one sample's shape, `TrainPipelineConfig.sde_mask`): only its True elements are
    stochastic; the others take the ODE (Euler) mean `x + v * dt`, get no noise, and are left out of the
    log-prob (the mean over the True elements). None (the default) leaves the step exactly as without it.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    if v.shape != x.shape:
        raise ValueError(f"v {tuple(v.shape)} and x {tuple(x.shape)} must have the same shape")
    if x.ndim < 1:
        raise ValueError("x must have a batch dimension")
    x = x.float()
    v = v.float()
    device, ndim, batch = x.device, x.ndim, x.shape[0]
    sig = _per_batch(sigma, "sigma", device, batch)
    sig_next = _per_batch(sigma_next, "sigma_next", device, batch)
    dt = sig_next - sig

    if sde_type == "ode":
        mean = x + v * _view(dt, ndim)
        zero = torch.zeros_like(torch.broadcast_tensors(sig, sig_next)[0])
        out = mean if prev_sample is None else prev_sample.float()
        return StepResult(prev_sample=out, mean=mean, std=zero, std_dev_t=zero, log_prob=None)

    a = _per_batch(noise_level, "noise_level", device, batch)
    if sde_type == "sde":
        if sigma_max is None:
            if bool((sig == 1).any()):
                raise ValueError("sde_step: sigma == 1 needs sigma_max (the schedule's sigmas[1]) for the guard")
            sig_guard = sig
        else:
            top = _per_batch(sigma_max, "sigma_max", device, batch)
            sig_guard = torch.where(sig > top, top, sig)
        std_dev_t = a * torch.sqrt(sig / (1 - sig_guard))
        std = a * torch.sqrt(sig * (-dt) / (1 - sig_guard))
        sd2, s_, dt_ = _view(std_dev_t**2, ndim), _view(sig, ndim), _view(dt, ndim)
        mean = x * (1 + sd2 / (2 * s_) * dt_) + v * (1 + sd2 * (1 - s_) / (2 * s_)) * dt_
    else:  # cps
        std = sig_next * torch.sin(a * (math.pi / 2))
        std_dev_t = std
        s_, sn_ = _view(sig, ndim), _view(sig_next, ndim)
        x0_hat = x - s_ * v
        x1_hat = x + (1 - s_) * v
        coef = torch.sqrt(torch.clamp(sig_next**2 - std**2, min=0.0))
        mean = x0_hat * (1 - sn_) + x1_hat * _view(coef, ndim)

    std, std_dev_t = torch.broadcast_tensors(std, std_dev_t, dt)[:2]
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[1:]):
            raise ValueError(f"mask must be a bool tensor of one sample's shape {tuple(x.shape[1:])}")
        mask = mask.to(device)
        mean = torch.where(mask, mean, x + v * _view(dt, ndim))
    deterministic = _is_zero_scalar(noise_level)
    if prev_sample is None:
        if deterministic:
            prev_sample = mean
        else:
            if noise is None:
                noise = draw_noise(x.shape, generator, device)
            elif noise.shape != x.shape:
                raise ValueError(f"noise {tuple(noise.shape)} must match x {tuple(x.shape)}")
            scaled = _view(std, ndim) * noise.float().to(device)
            prev_sample = mean + (scaled if mask is None else torch.where(mask, scaled, torch.zeros_like(scaled)))
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample {tuple(prev_sample.shape)} must match x {tuple(x.shape)}")
        prev_sample = prev_sample.float()
    log_prob = None if deterministic else step_log_prob(prev_sample.detach(), mean, std, sde_type, no_const, mask)
    return StepResult(prev_sample=prev_sample, mean=mean, std=std, std_dev_t=std_dev_t, log_prob=log_prob)
