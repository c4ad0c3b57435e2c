"""Diffusion-DPO for flow matching (`--loss-type dpo`, algorithms_next.md D).

A pair is a preferred (winner, `w`) and a rejected (loser, `l`) clean latent of one prompt. Both are noised with
**one** noise draw and **one** sigma (trap D.5.2: with independent draws the noise term does not cancel)::

    x_t^{w,l} = (1 - sigma) * x0^{w,l} + sigma * noise
    e(x0)     = mean_D((v(x_t, t, c) - (noise - x0))**2)          # denoising_error, per pair member
    Delta     = e_theta(x0) - e_ref(x0)                           # the reference forward carries no grad
    z         = -(beta / 2) * (Delta_w - Delta_l)
    loss      = mean_pairs(-log sigmoid(z))                       # dpo_loss; beta = --diffusion-dpo-beta

This is flow_grpo's, Flow-Factory's and verl-omni's form. diffusers' Diffusion-DPO writes
`-log sigmoid(beta_d * ((e_ref^w - e_ref^l) - (e_theta^w - e_theta^l)))`, the same loss with `beta_d = beta / 2`
(its `beta_dpo` 2500 is our beta 5000). The error is the v-form (velocity target `noise - x0`): as
`eps_hat - eps = (1 - sigma) * (v_hat - v)`, it is the eps-form error divided by `(1 - sigma)**2`, so the same beta
weighs high-noise sigmas more than an eps-target DPO does (16x at sigma = 0.75).

Gradient: `dL/de_theta^w = (beta / 2) * (1 - sigmoid(z)) = -dL/de_theta^l`; at theta = ref the loss is ln 2 and each
error term gets +-beta / 4, so descent lowers the winner's error and raises the loser's.

Online pairs (`preference_pairs`): per prompt group, the best against the worst reward. The tie rule (ours; the
peers differ, D.2 and trap D.5.3): a group whose best and worst rewards are equal gives **no pair** (it carries no
preference, and the peers' arbitrary labels or self-pairs only add noise or nothing; such groups are counted);
among equal best rewards the first index wins and among equal worst rewards the last index loses (verl-omni's
stable descending sort, first against last). A group with one sample gives no pair either.

Noise levels (`dpo_sigmas`): flow_grpo's and verl-omni's logit-normal draw on the pretrained scheduler's grid,
`u = sigmoid(z)` with `z ~ N(0, 1)`, `k = floor(N * u)` (N = 1000), `sigma = shift(1 - k / N)`: index k of
`FlowMatchEulerDiscreteScheduler(N, shift=s).sigmas`, the `sigma_grid` of `miles.algorithms.sft_loss` read from the
noise end (s = `--fsdp-flow-shift`; the peers' SD3 grid has s = 3: median sigma 0.75).

Pure tensor math: no model forward, no Ray, no diffusers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from miles.algorithms.sft_loss import mean_non_batch, promote, sigma_grid

__all__ = [
    "PairSelection",
    "denoising_error",
    "dpo_loss",
    "dpo_sigmas",
    "group_pair",
    "preference_pairs",
    "sigmas_at",
]


# --------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------


def denoising_error(
    v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B]` per-sample flow-matching error `mean_D((v_pred - (noise - x0))**2)` (over the `mask` elements only when
    given: a bool tensor of one sample's shape, the family's `data_mask`). `x0` and `noise` are data (no grad)."""
    if v_pred.shape != x0.shape or noise.shape != x0.shape:
        raise ValueError(
            f"v_pred {tuple(v_pred.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must match"
        )
    v_pred = promote(v_pred)
    target = (promote(noise).detach() - promote(x0).detach()).to(v_pred.dtype)
    err = (v_pred - target) ** 2
    if mask is None:
        return mean_non_batch(err)
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x0.shape[1:]):
        raise ValueError(f"mask must be a bool tensor of one sample's shape {tuple(x0.shape[1:])}")
    return err.flatten(1)[:, mask.to(err.device).flatten()].mean(dim=1)


def dpo_loss(
    e_theta_w: torch.Tensor,
    e_theta_l: torch.Tensor,
    e_ref_w: torch.Tensor,
    e_ref_l: torch.Tensor,
    beta: float = 100.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The flow DPO loss `mean_pairs(weight * -log sigmoid(-(beta / 2) * (Delta_w - Delta_l)))` and its metrics.

    e_theta_w, e_theta_l   `[P]` the trained policy's errors of winners and losers (carry the graph)
    e_ref_w, e_ref_l       `[P]` the reference's errors (detached here)
    beta                   `--diffusion-dpo-beta` (> 0), flow_grpo's convention (diffusers' beta_d = beta / 2)
    weight                 optional `[P]` per-pair weight (default 1): every value, loss and metric alike, is the
                           mean of weight * value, so a zero weight drops a pair (the trainer's rank padding)

    Metrics: loss; implicit_accuracy (the fraction of pairs with Delta_w < Delta_l, strict: 0 at theta = ref);
    margin (the mean of Delta_l - Delta_w, > 0 when the policy moved toward the winner relative to the reference);
    e_theta_winner, e_ref_winner, e_theta_loser, e_ref_loser (the mean errors).
    """
    if not beta > 0:
        raise ValueError(f"--diffusion-dpo-beta must be > 0, got {beta}")
    shape = e_theta_w.shape
    for name, t in (("e_theta_l", e_theta_l), ("e_ref_w", e_ref_w), ("e_ref_l", e_ref_l)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match e_theta_w {tuple(shape)}")
    e_theta_w, e_theta_l = promote(e_theta_w), promote(e_theta_l)
    dtype = e_theta_w.dtype
    e_ref_w, e_ref_l = promote(e_ref_w).detach().to(dtype), promote(e_ref_l).detach().to(dtype)
    w = torch.ones_like(e_theta_w) if weight is None else torch.as_tensor(weight).to(e_theta_w)
    if w.shape != shape:
        raise ValueError(f"weight {tuple(w.shape)} must match the pairs {tuple(shape)}")
    delta_w = e_theta_w - e_ref_w
    delta_l = e_theta_l - e_ref_l
    z = -(beta / 2) * (delta_w - delta_l)
    loss = (w * F.softplus(-z)).mean()  # softplus(-z) = -log sigmoid(z), stable for large |z|

    def mean(values: torch.Tensor) -> float:
        return float((w * values.detach().to(dtype)).mean())

    with torch.no_grad():
        metrics = {
            "loss": float(loss.detach()),
            "implicit_accuracy": mean((delta_w < delta_l).to(dtype)),
            "margin": mean(delta_l - delta_w),
            "e_theta_winner": mean(e_theta_w),
            "e_ref_winner": mean(e_ref_w),
            "e_theta_loser": mean(e_theta_l),
            "e_ref_loser": mean(e_ref_l),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# Online pairs
# --------------------------------------------------------------------------------------------------


def group_pair(rewards: Sequence[float]) -> tuple[int, int] | None:
    """(winner, loser) positions of one prompt group under the tie rule (module docstring), or None: fewer than
    two samples, or best == worst (no preference). Among equal best rewards the first position wins, among equal
    worst rewards the last loses."""
    values = [float(r) for r in rewards]
    bad = [i for i, r in enumerate(values) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"reward {values[bad[0]]} at group position {bad[0]} is not finite: it cannot rank a pair")
    if len(values) < 2:
        return None
    best, worst = max(values), min(values)
    if best == worst:
        return None
    winner = values.index(best)
    loser = len(values) - 1 - values[::-1].index(worst)
    return winner, loser


@dataclass
class PairSelection:
    """The pairs of a window: `pairs` as (winner, loser) indices into its samples, in group order; `tied_groups`
    (best == worst) and `single_groups` (one sample) gave none."""

    pairs: list[tuple[int, int]] = field(default_factory=list)
    tied_groups: int = 0
    single_groups: int = 0


def preference_pairs(groups: Sequence[Hashable], rewards: Sequence[float]) -> PairSelection:
    """One pair per prompt group (`groups[i]`: sample i's group id; groups in order of first appearance, a group's
    positions in sample order) by `group_pair`."""
    if len(groups) != len(rewards):
        raise ValueError(f"{len(groups)} group ids but {len(rewards)} rewards")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = PairSelection()
    for indices in members.values():
        chosen = group_pair([rewards[i] for i in indices])
        if chosen is not None:
            out.pairs.append((indices[chosen[0]], indices[chosen[1]]))
        elif len(indices) < 2:
            out.single_groups += 1
        else:
            out.tied_groups += 1
    return out


# --------------------------------------------------------------------------------------------------
# Noise levels
# --------------------------------------------------------------------------------------------------


def sigmas_at(u: torch.Tensor, shift: float | None = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The grid sigma of each `u` in [0, 1]: index `k = floor(N * u)` (at most N - 1) of the scheduler's sigmas
    (noise first), `shift(1 - k / N)`. float32, u's shape; the timestep is `1000 * sigma`."""
    n = int(num_train_timesteps)
    grid = sigma_grid(n, shift)  # ascending: grid[j] = shift((j + 1) / N), so scheduler index k is grid[N - 1 - k]
    u = torch.as_tensor(u, dtype=torch.float64)
    k = torch.floor(u * n).clamp(0, n - 1).long()
    return grid[n - 1 - k].to(torch.float32)


def dpo_sigmas(
    count: int, generator: torch.Generator | None = None, shift: float | None = 3.0, num_train_timesteps: int = 1000
) -> torch.Tensor:
    """`[count]` fp32 training sigmas, logit-normal on the scheduler grid (`sigmas_at(sigmoid(z))`, z ~ N(0, 1))."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    device = generator.device if generator is not None else "cpu"
    z = torch.randn(count, generator=generator, device=device, dtype=torch.float64).cpu()
    return sigmas_at(torch.sigmoid(z), shift, num_train_timesteps)
