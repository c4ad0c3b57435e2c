"""Flow-GRPO's clipped policy loss (`--loss-type policy_loss`) with the optional reference KL (algorithms.md B.5).

Per trained transition (one per sample, or one per sample and step when the inputs are `[B, T]`)::

    A        = clamp(A, -adv_clip_max, adv_clip_max)                 # --diffusion-adv-clip-max (5)
    ratio    = exp(log_prob_new - log_prob_old)
    per      = max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps))   # eps = --diffusion-clip-range (1e-4)
    kl       = mean_CHW((mean_new - mean_ref)**2) / (2 * std_dev_t**2)   # per sample
    loss     = mean(per) + kl_beta * mean(kl)                          # kl_beta = --diffusion-kl-beta

GRPO-Guard (`--diffusion-grpo-guard`) passes its normalised `log_ratio` for `log(ratio)` and a per-transition
`weight` (`1/|dt|`) that multiplies `per` before the mean (`miles.algorithms.grpo_guard`).

The log-probs are the per-sample *means* over the non-batch dims that `miles.sampling.sde.sde_step` returns, and
the KL divides by `std_dev_t**2` without the `|dt|` factor and averages over elements; both conventions come
from flow_grpo and the tuned `eps` and `kl_beta` values depend on them. The exact Gaussian KL of the two step
kernels is `kl * (C*H*W) / |dt|`.

`log_prob_old` is the behaviour policy's value (the engine's, or a trainer recompute) and is never
differentiated. `mean_ref` is detached too. The loss is a mean, so callers that accumulate over micro-steps
divide by their count as usual.
"""

from __future__ import annotations

import torch

from miles.algorithms.sft_loss import mean_non_batch, promote

__all__ = ["clamp_advantages", "flow_grpo_kl", "policy_loss"]

REF_MODE_HINT = "set --ref-mode lora_base or ema (auto: lora_base when --diffusion-kl-beta > 0)"


def clamp_advantages(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """`clamp(A, -adv_clip_max, adv_clip_max)`."""
    if adv_clip_max < 0:
        raise ValueError(f"adv_clip_max must be >= 0, got {adv_clip_max}")
    return torch.clamp(advantages, -adv_clip_max, adv_clip_max)


def flow_grpo_kl(mean_new: torch.Tensor, mean_ref: torch.Tensor, std_dev_t: torch.Tensor | float) -> torch.Tensor:
    """Per-sample KL surrogate `mean_CHW((mean_new - mean_ref)**2) / (2 * std_dev_t**2)`, shape `[B]`.

    `std_dev_t` is `StepResult.std_dev_t` of the trained policy's step (a number, 0-d or `[B]`); `mean_ref` is
    detached. It must be positive: an ode step (std_dev_t = 0) has no KL.
    """
    if mean_new.shape != mean_ref.shape:
        raise ValueError(f"mean_new {tuple(mean_new.shape)} and mean_ref {tuple(mean_ref.shape)} must match")
    mean_new = promote(mean_new)
    diff_sq = mean_non_batch((mean_new - promote(mean_ref).detach().to(mean_new.dtype)) ** 2)
    sd = torch.as_tensor(std_dev_t).to(device=mean_new.device, dtype=mean_new.dtype)
    if sd.ndim > 1 or (sd.ndim == 1 and sd.shape[0] != mean_new.shape[0]):
        raise ValueError(f"std_dev_t must be a number, 0-d or [{mean_new.shape[0]}], got {tuple(sd.shape)}")
    if bool((sd <= 0).any()):
        raise ValueError("std_dev_t must be > 0 for the KL term (an ode step has no density)")
    return diff_sq / (2 * sd.detach() ** 2)


def policy_loss(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
    mean_new: torch.Tensor | None = None,
    mean_ref: torch.Tensor | None = None,
    std_dev_t: torch.Tensor | float | None = None,
    log_ratio: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO loss and diagnostics.

    log_prob_new  `[B]` (or `[B, T]`) trainer log-probs of the stored transitions (carries the graph)
    log_prob_old  same shape, the behaviour policy's log-probs (detached)
    advantages    same shape, or `[B]` broadcast over a trailing step dim
    clip_range    PPO ratio clip eps (> 0)
    adv_clip_max  advantage clamp (>= 0)
    kl_beta       KL coefficient; 0 skips the KL, so `mean_ref` may be None
    mean_new      `[B, ...]` trained step mean (`StepResult.mean`), needed when kl_beta > 0
    mean_ref      `[B, ...]` reference step mean (no grad), needed when kl_beta > 0
    std_dev_t     the trained step's `StepResult.std_dev_t` (number, 0-d or `[B]`), needed when kl_beta > 0
    log_ratio     the log-ratio to clip instead of `log_prob_new - log_prob_old` (GRPO-Guard's RatioNorm,
                  `miles.algorithms.grpo_guard`); same shape, carries the graph
    weight        a per-transition weight of the clipped term (GRPO-Guard's `1/|dt|`), `[B]` or the log-probs' shape

    With kl_beta == 0 but all three KL inputs given, `kl_loss` is still reported (computed without grad).
    Metrics: loss, policy_loss, kl_loss, loss_abs_mean, clipfrac, clipfrac_gt_one, clipfrac_lt_one,
    approx_kl, ratio_mean, ratio_abs_minus_1, log_prob_mean_abs_diff, adv_abs_mean.
    """
    if clip_range <= 0:
        raise ValueError(f"--diffusion-clip-range must be > 0, got {clip_range}")
    if kl_beta < 0:
        raise ValueError(f"--diffusion-kl-beta must be >= 0, got {kl_beta}")
    if log_prob_new.shape != log_prob_old.shape:
        raise ValueError(
            f"log_prob_new {tuple(log_prob_new.shape)} and log_prob_old {tuple(log_prob_old.shape)} must match"
        )
    log_prob_new = promote(log_prob_new)
    log_prob_old = promote(log_prob_old).detach().to(log_prob_new.dtype)
    adv = promote(advantages).detach().to(device=log_prob_new.device, dtype=log_prob_new.dtype)
    if adv.ndim == 1 and log_prob_new.ndim == 2 and adv.shape[0] == log_prob_new.shape[0]:
        adv = adv[:, None]
    adv = clamp_advantages(adv, adv_clip_max).expand_as(log_prob_new)

    delta = log_prob_new - log_prob_old
    if log_ratio is not None:
        if log_ratio.shape != log_prob_new.shape:
            raise ValueError(f"log_ratio {tuple(log_ratio.shape)} must match log_prob_new {tuple(log_prob_new.shape)}")
        ratio = torch.exp(promote(log_ratio).to(log_prob_new.dtype))
    else:
        ratio = torch.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per = torch.maximum(unclipped, clipped)
    if weight is not None:
        w = promote(weight).detach().to(device=per.device, dtype=per.dtype)
        per = per * (w[:, None] if w.ndim == 1 and per.ndim == 2 else w)
    pg_loss = per.mean()

    kl_inputs = (mean_new, mean_ref, std_dev_t)
    kl_loss = None
    if kl_beta > 0:
        if mean_ref is None:
            raise ValueError(f"the Flow-GRPO KL (--diffusion-kl-beta > 0) needs a reference forward: {REF_MODE_HINT}")
        if mean_new is None or std_dev_t is None:
            raise ValueError("the Flow-GRPO KL (--diffusion-kl-beta > 0) needs mean_new and std_dev_t")
        kl_loss = flow_grpo_kl(mean_new, mean_ref, std_dev_t).mean()
        loss = pg_loss + kl_beta * kl_loss
    else:
        loss = pg_loss
        if all(x is not None for x in kl_inputs):
            with torch.no_grad():
                kl_loss = flow_grpo_kl(mean_new.detach(), mean_ref, std_dev_t).mean()

    with torch.no_grad():
        d = delta.detach()  # the engine-trainer log-prob difference, whatever ratio is clipped
        r = ratio.detach()
        metrics = {
            "loss": float(loss),
            "policy_loss": float(pg_loss),
            "kl_loss": float(kl_loss) if kl_loss is not None else 0.0,
            "loss_abs_mean": float(per.detach().abs().mean()),
            "clipfrac": float(((r - 1).abs() > clip_range).float().mean()),
            "clipfrac_gt_one": float((r - 1 > clip_range).float().mean()),
            "clipfrac_lt_one": float((1 - r > clip_range).float().mean()),
            "approx_kl": float(0.5 * (d**2).mean()),
            "ratio_mean": float(r.mean()),
            "ratio_abs_minus_1": float((r - 1).abs().mean()),
            "log_prob_mean_abs_diff": float(d.abs().mean()),
            "adv_abs_mean": float(adv.abs().mean()),
        }
    return loss, metrics
