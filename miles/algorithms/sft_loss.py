"""Supervised flow matching (`--loss-type sft_loss`) and the rectified-flow basics the other losses share.

Rectified flow (SD3 convention, algorithms.md §0): `x_sigma = (1 - sigma) * x0 + sigma * noise` with
sigma in [0, 1], and the model predicts the velocity `v = noise - x0`. The SFT loss is the plain
flow-matching MSE `mean((v_pred - (noise - x0))**2)` over every element, with no timestep weighting.

Training sigmas (`sample_sigmas`) are drawn uniformly over a grid: the engine's scheduler sigmas when the
caller has them, else the `num_train_timesteps` values `k / N` (k = 1..N) shifted with the static SD3 shift
`s * sigma / (1 + (s - 1) * sigma)` of `--fsdp-flow-shift s` (no shift when it is unset). Uniform
indices over a shifted grid is what diffusers' SD3 training scripts do with the "none" weighting scheme.

Pure tensor math: no model forward, no Ray, no diffusers. Half-precision inputs are promoted to fp32;
fp32/fp64 inputs keep their dtype (so the tests can run in fp64).
"""

from __future__ import annotations

import torch

from miles.sampling.sde import shift_sigmas

Scalar = float | int | torch.Tensor

__all__ = [
    "batch_view",
    "flow_matching_target",
    "mean_non_batch",
    "noisy_latents",
    "promote",
    "sample_sigmas",
    "sft_loss",
    "sigma_grid",
]


# --------------------------------------------------------------------------------------------------
# Shared helpers (also used by nft.py and dmd2.py)
# --------------------------------------------------------------------------------------------------


def promote(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32; every other dtype unchanged (fp32 stays fp32, fp64 stays fp64)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def batch_view(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """`value` (a number, 0-d, `[B]`, or already `[B, 1, ...]`) as a tensor broadcasting against `like` `[B, ...]`.

    The result is on `like`'s device in `like`'s (promoted) dtype.
    """
    t = torch.as_tensor(value).to(device=like.device, dtype=promote(like).dtype)
    if t.ndim == 0 or t.ndim == like.ndim:
        return t
    if t.ndim == 1 and t.shape[0] == like.shape[0]:
        return t.reshape(-1, *([1] * (like.ndim - 1)))
    raise ValueError(f"expected a number, a 0-d tensor or a per-batch tensor [{like.shape[0]}], got {tuple(t.shape)}")


def mean_non_batch(t: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over every dim but the first: `[B, ...] -> [B]` (a 1-D tensor is returned as is)."""
    return t if t.ndim <= 1 else t.mean(dim=tuple(range(1, t.ndim)))


def flow_matching_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity target `noise - x0`."""
    return promote(noise) - promote(x0)


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigma: Scalar) -> torch.Tensor:
    """Forward noising `(1 - sigma) * x0 + sigma * noise`; `sigma` is a number, 0-d or `[B]`."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape")
    x0, noise = promote(x0), promote(noise)
    s = batch_view(sigma, x0)
    return (1 - s) * x0 + s * noise


# --------------------------------------------------------------------------------------------------
# Timestep sampling
# --------------------------------------------------------------------------------------------------


def sigma_grid(num_train_timesteps: int = 1000, shift: float | None = None) -> torch.Tensor:
    """The training-side sigma grid, `[N]` float64 ascending: `shift_sigmas(k / N, shift)` for k = 1..N (shift None
    or 1: no shift). Reversed, it is `FlowMatchEulerDiscreteScheduler(N, shift=shift).sigmas` (noise first)."""
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    grid = torch.arange(1, num_train_timesteps + 1, dtype=torch.float64) / num_train_timesteps
    if shift is not None:
        if shift <= 0:
            raise ValueError(f"--fsdp-flow-shift must be > 0, got {shift}")
        grid = shift_sigmas(grid, float(shift))
    return grid


def sample_sigmas(
    batch: int,
    generator: torch.Generator | None = None,
    shift: float | None = None,
    sigmas_grid: torch.Tensor | None = None,
    *,
    num_train_timesteps: int = 1000,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`[batch]` fp32 training sigmas, each drawn uniformly from a grid.

    The grid is `sigmas_grid` when given (e.g. the rollout scheduler's sigmas; zeros are dropped, and it is
    used as is, `shift` is not applied to it), else `shift_sigmas(k / N, shift)` for k = 1..N with
    N = `num_train_timesteps` (shift None or 1 means no shift). The draw uses `generator` (on its device)
    and the result is moved to `device`.
    """
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    if sigmas_grid is None:
        grid = sigma_grid(num_train_timesteps, shift).to(torch.float32)
    else:
        grid = torch.as_tensor(sigmas_grid).detach().to("cpu", torch.float32).reshape(-1)
        grid = grid[grid != 0]
        if grid.numel() == 0:
            raise ValueError("sigmas_grid has no non-zero sigma to train on")
        if bool(((grid < 0) | (grid > 1)).any()):
            raise ValueError("sigmas_grid values must lie in [0, 1]")
    gen_device = generator.device if generator is not None else "cpu"
    idx = torch.randint(0, grid.numel(), (batch,), generator=generator, device=gen_device).cpu()
    return grid[idx].to(device if device is not None else gen_device)


# --------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------


def sft_loss(
    v_pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: Scalar | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-matching loss `mean((v_pred - (noise - x0))**2)` over all elements (or the `mask` ones).

    v_pred  the model's velocity at `noisy_latents(x0, noise, sigma)`, `[B, ...]` (carries the graph)
    x0      clean latents `[B, ...]` (treated as data: detached)
    noise   the noise used to build the model input, `[B, ...]` (detached)
    sigma   optional (number, 0-d or `[B]`); it does not weight the loss, it only adds the x0-space
            diagnostic `x0_mse = mean(sigma**2 * (v_pred - target)**2)` (the error of `x_t - sigma * v_pred`)
    mask    optional bool tensor of one sample's shape (the family's `data_mask`, e.g. LTX-2's video channels):
            only its True elements carry data, and loss and metrics are means over them

    Metrics: loss, target_abs_mean, pred_abs_mean, and x0_mse when `sigma` is given.
    """
    if v_pred.shape != x0.shape or noise.shape != x0.shape:
        raise ValueError(
            f"v_pred {tuple(v_pred.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must match"
        )
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x0.shape[1:]):
            raise ValueError(f"mask must be a bool tensor of one sample's shape {tuple(x0.shape[1:])}")
        keep = mask.to(v_pred.device).flatten()
        v_pred, x0, noise = (t.flatten(1)[:, keep] for t in (v_pred, x0, noise))
    v_pred = promote(v_pred)
    target = flow_matching_target(x0.detach(), noise.detach()).to(v_pred.dtype)
    err = v_pred - target
    loss = (err**2).mean()
    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "target_abs_mean": float(target.abs().mean()),
            "pred_abs_mean": float(v_pred.abs().mean()),
        }
        if sigma is not None:
            metrics["x0_mse"] = float((batch_view(sigma, err) ** 2 * err**2).mean())
    return loss, metrics
