"""DMD2 distillation on a rectified-flow teacher (`--loss-type dmd2` / `dmd2_critic`; algorithms.md A.3-A.6, A.10).

DMD2 works in x0 space, so the port to rectified flow (`x_sigma = (1 - sigma) * x0 + sigma * eps`,
`v = eps - x0`) only swaps the conversions::

    x0_hat  = x_sigma - sigma * v                 # x0_from_velocity
    eps_hat = x_sigma + (1 - sigma) * v           # eps_from_velocity
    score   = -eps_hat / sigma                    # score_from_velocity

Generator (distribution matching, tianweiy/DMD2 main/sd_guidance.py), `x = x0_gen` with grad::

    x_t     = add_noise(sg(x), eps, sigma)        sigma from dm_timesteps (default [0.02, 0.98])
    x0_real = x0(x_t, cfg(v_u, v_c, w_real))      frozen teacher, CFG  (--dmd2-real-guidance-scale)
    x0_fake = x0(x_t, v_fake)                     critic, no CFG
    grad    = (x0_fake - x0_real) / mean_CHW|x - x0_real|     per sample, no grad; nan/inf -> 0
    L_DM    = 0.5 * mean((x - sg(x - grad))**2)   so dL/dx = grad / x.numel()

Critic (fake score): flow matching on detached student samples, `mean((v_fake(x_t, sigma) - (eps - sg(x0)))**2)`
with sigma over the full range (`dm_timesteps(..., 0.0, 1.0)`). GAN head (non-saturating logistic):
`L_D = mean softplus(D(fake)) + mean softplus(-D(real))`, `L_G = mean softplus(-D(fake))`. Two time-scale
update rule: the critic steps every iteration, the generator when `step % ratio == 0`.

Pure tensor math: the trainer runs the networks and passes their predictions in.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from miles.algorithms.sft_loss import (
    batch_view,
    mean_non_batch,
    noisy_latents,
    promote,
    sft_loss,
)
from miles.sampling.sde import shift_sigmas

__all__ = [
    "add_noise",
    "cfg_combine",
    "dm_gradient",
    "dm_timesteps",
    "dmd2_critic_loss",
    "dmd2_generator_loss",
    "eps_from_velocity",
    "gan_discriminator_loss",
    "gan_generator_loss",
    "is_generator_step",
    "score_from_velocity",
    "x0_from_velocity",
]

Scalar = float | int | torch.Tensor


# --------------------------------------------------------------------------------------------------
# Rectified-flow conversions and CFG
# --------------------------------------------------------------------------------------------------


def add_noise(x0: torch.Tensor, eps: torch.Tensor, sigma: Scalar) -> torch.Tensor:
    """`(1 - sigma) * x0 + sigma * eps` (sigma: a number, 0-d or `[B]`)."""
    return noisy_latents(x0, eps, sigma)


def x0_from_velocity(x_t: torch.Tensor, sigma: Scalar, v: torch.Tensor) -> torch.Tensor:
    """`x_t - sigma * v`."""
    x_t, v = promote(x_t), promote(v)
    return x_t - batch_view(sigma, x_t) * v


def eps_from_velocity(x_t: torch.Tensor, sigma: Scalar, v: torch.Tensor) -> torch.Tensor:
    """`x_t + (1 - sigma) * v`."""
    x_t, v = promote(x_t), promote(v)
    return x_t + (1 - batch_view(sigma, x_t)) * v


def score_from_velocity(x_t: torch.Tensor, sigma: Scalar, v: torch.Tensor) -> torch.Tensor:
    """`grad log p_sigma(x_t) = -(x_t + (1 - sigma) * v) / sigma` (sigma > 0)."""
    return -eps_from_velocity(x_t, sigma, v) / batch_view(sigma, promote(x_t))


def cfg_combine(v_uncond: torch.Tensor | None, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance `v_u + w * (v_c - v_u)`; `w == 1` returns `v_cond` itself (v_uncond may be None)."""
    if scale == 1:
        return v_cond
    if v_uncond is None:
        raise ValueError(f"CFG scale {scale} != 1 needs the unconditional prediction")
    return v_uncond + scale * (v_cond - v_uncond)


# --------------------------------------------------------------------------------------------------
# Timesteps and the update schedule
# --------------------------------------------------------------------------------------------------


def _floor_ratio(ratio: float, n: int) -> int:
    # int(ratio * n) as DMD2 computes it, robust to 0.29 * 1000 = 289.99999999999994
    return math.floor(ratio * n + 1e-9)


def dm_timesteps(
    batch: int,
    min_ratio: float = 0.02,
    max_ratio: float = 0.98,
    generator: torch.Generator | None = None,
    *,
    num_train_timesteps: int = 1000,
    shift: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`[batch]` fp32 sigmas `t / N` with integer `t ~ U{int(min*N), ..., min(int(max*N), N - 1)}`.

    Defaults give DMD2's DM range t in [20, 980] (`--dmd2-min-step-ratio`/`--dmd2-max-step-ratio`);
    `dm_timesteps(B, 0.0, 1.0)` gives the critic's full range [0, N - 1]. With `shift`, the sigmas are then
    SD3-shifted and clamped back to `[min_ratio, max_ratio]` (the Self-Forcing variant; off by default).
    """
    if not 0 <= min_ratio <= max_ratio <= 1:
        raise ValueError(f"need 0 <= min_ratio <= max_ratio <= 1, got {min_ratio}, {max_ratio}")
    n = num_train_timesteps
    lo = _floor_ratio(min_ratio, n)
    hi = min(_floor_ratio(max_ratio, n) + 1, n)  # DMD2: randint(min_step, min(max_step + 1, N))
    if hi <= lo:
        raise ValueError(f"empty timestep range [{lo}, {hi}) for ratios {min_ratio}, {max_ratio}")
    gen_device = generator.device if generator is not None else "cpu"
    t = torch.randint(lo, hi, (batch,), generator=generator, device=gen_device)
    sigma = t.to(torch.float64) / n
    if shift is not None:
        sigma = shift_sigmas(sigma, float(shift)).clamp(lo / n, (hi - 1) / n)
    return sigma.to(device=device if device is not None else gen_device, dtype=torch.float32)


def is_generator_step(step: int, ratio: int) -> bool:
    """TTUR: the student steps when `step % ratio == 0` (`--dmd2-critic-update-ratio`); the critic every step."""
    if ratio < 1:
        raise ValueError(f"--dmd2-critic-update-ratio must be >= 1, got {ratio}")
    return step % ratio == 0


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def dm_gradient(x0_gen: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> torch.Tensor:
    """The normalized DM direction `(x0_fake - x0_real) / mean_CHW|x0_gen - x0_real|` per sample, no grad.

    Non-finite entries (a zero normalizer: x0_gen == x0_real) become 0, so such a sample adds no gradient.
    """
    if not (x0_gen.shape == x0_real.shape == x0_fake.shape):
        raise ValueError(
            f"x0_gen {tuple(x0_gen.shape)}, x0_real {tuple(x0_real.shape)} "
            f"and x0_fake {tuple(x0_fake.shape)} must match"
        )
    with torch.no_grad():
        x = promote(x0_gen).detach()
        real = promote(x0_real).detach().to(x.dtype)
        fake = promote(x0_fake).detach().to(x.dtype)
        norm = batch_view(mean_non_batch((x - real).abs()), x)
        # DMD2's bare nan_to_num turns c / 0 into +-max-float, whose square overflows the loss to inf;
        # a sample with a zero normalizer has no defined step size, so it contributes no gradient at all.
        return torch.nan_to_num((fake - real) / norm, nan=0.0, posinf=0.0, neginf=0.0)


def dmd2_generator_loss(
    x0_gen: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Distribution-matching loss `0.5 * mean((x0_gen - sg(x0_gen - grad))**2)`; its gradient is `grad / numel`.

    x0_gen   the student's output `[B, ...]` (carries the graph)
    x0_real  the teacher's x0 estimate at `add_noise(sg(x0_gen), eps, sigma)`, with CFG (no grad)
    x0_fake  the critic's x0 estimate at the same point, no CFG (no grad)

    Metrics: loss, dm_grad_abs_mean, dm_norm_mean (the per-sample normalizer), real_fake_abs_mean.
    """
    grad = dm_gradient(x0_gen, x0_real, x0_fake)
    x = promote(x0_gen)
    loss = 0.5 * F.mse_loss(x, (x - grad).detach(), reduction="mean")
    with torch.no_grad():
        xd = x.detach()
        real = promote(x0_real).detach().to(xd.dtype)
        metrics = {
            "loss": float(loss),
            "dm_grad_abs_mean": float(grad.abs().mean()),
            "dm_norm_mean": float(mean_non_batch((xd - real).abs()).mean()),
            "real_fake_abs_mean": float((promote(x0_fake).detach().to(xd.dtype) - real).abs().mean()),
        }
    return loss, metrics


def dmd2_critic_loss(
    v_fake: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, sigma: Scalar | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic (fake score) loss: flow matching `mean((v_fake - (noise - sg(x0)))**2)` on detached student samples.

    v_fake  the critic's velocity at `add_noise(sg(x0), noise, sigma)`, `[B, ...]` (carries the critic's graph)
    noise   the noise of that input; x0 the student's samples (detached here, so no student gradient)
    sigma   optional, for the `x0_mse` diagnostic only
    """
    return sft_loss(v_fake, x0.detach(), noise.detach(), sigma)


def gan_generator_loss(logits_fake: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Non-saturating generator loss `mean softplus(-D(fake))` (= log 2 at logit 0)."""
    logits_fake = promote(logits_fake)
    loss = F.softplus(-logits_fake).mean()
    with torch.no_grad():
        metrics = {"loss": float(loss), "logits_fake_mean": float(logits_fake.mean())}
    return loss, metrics


def gan_discriminator_loss(
    logits_fake: torch.Tensor, logits_real: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Discriminator loss `mean softplus(D(fake)) + mean softplus(-D(real))` (= 2 log 2 at logits 0).

    The caller computes `logits_fake` on detached student samples; both are the head's raw logits.
    """
    logits_fake, logits_real = promote(logits_fake), promote(logits_real)
    loss_fake = F.softplus(logits_fake).mean()
    loss_real = F.softplus(-logits_real).mean()
    loss = loss_fake + loss_real
    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "loss_fake": float(loss_fake),
            "loss_real": float(loss_real),
            "logits_fake_mean": float(logits_fake.mean()),
            "logits_real_mean": float(logits_real.mean()),
            "accuracy": float(((logits_fake < 0).float().mean() + (logits_real > 0).float().mean()) / 2),
        }
    return loss, metrics
