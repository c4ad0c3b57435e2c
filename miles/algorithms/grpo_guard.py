"""GRPO-Guard (`--diffusion-grpo-guard`, an option of `--loss-type policy_loss`; algorithms_next.md A).

With Flow-GRPO's Gaussian step kernel the per-step log-ratio has a deterministic negative bias that grows as the
step's std `s` shrinks (late, low-noise steps)::

    log rho = l_new - l_old = mean_D(xi * dmu) / s - mean_D(dmu**2) / (2 s**2)      dmu = mean_new - mean_old

so PPO's clip stops binding on over-confident positive-advantage updates. RatioNorm removes the bias and rescales::

    b           = mean_D((mean_new - mean_old)**2) / (2 s**2)                          per sample [B]
    log rho_hat = s * (l_new - l_old + b)          ( = mean_D(xi * dmu) exactly: mean 0 under the rollout noise)

and the step's clipped loss is divided by `|dt|`, which makes every step's gradient weight `c = 1 + a**2/2`
(1 at sigma = 1) instead of vanilla's `c |dt| / s` (about 26x larger at step 8 than at step 0 of SD3.5's
10-step schedule). `s` is taken per row here; the peers take a batch mean of `std_dev_t` times a batch mean of
`sqrt|dt|`, the same number when every row of a micro-batch is at the same step, as theirs always are.

It holds for the Flow-SDE kernel only (the log-prob must be the full Gaussian with its `1/(2 s**2)`); CPS drops
that factor and the config rules refuse the option there. The `-log s` constants cancel (both log-probs use the
same `s`), so `--diffusion-log-prob-no-const` does not change the result.
"""

from __future__ import annotations

import torch

from miles.algorithms.sft_loss import mean_non_batch, promote

__all__ = ["ratio_bias", "ratio_norm_log_ratio", "step_weight"]


def _per_row(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(value).to(device=like.device, dtype=like.dtype)
    return t.expand(like.shape[0]) if t.ndim == 0 else t.reshape(like.shape[0])


def _mean_d(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The per-sample mean over the latent elements (only the stochastic ones when `mask` is given)."""
    if mask is None:
        return mean_non_batch(t)
    keep = mask.to(t.device).expand(t.shape[1:]).reshape(-1)
    return t.reshape(t.shape[0], -1)[:, keep].mean(dim=1)


def ratio_bias(
    mean_new: torch.Tensor, mean_old: torch.Tensor, std: torch.Tensor | float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`b = mean_D((mean_new - mean_old)**2) / (2 s**2)` per sample `[B]`: minus the expected vanilla log-ratio under
    the rollout's noise (so >= 0); carries the graph of `mean_new`."""
    mean_new = promote(mean_new)
    diff_sq = _mean_d((mean_new - promote(mean_old).detach().to(mean_new.dtype)) ** 2, mask)
    s = _per_row(std, diff_sq).detach()
    if bool((s <= 0).any()):
        raise ValueError("GRPO-Guard needs a positive step std (an ode step has no density)")
    return diff_sq / (2 * s**2)


def ratio_norm_log_ratio(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    mean_new: torch.Tensor,
    mean_old: torch.Tensor,
    std: torch.Tensor | float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """RatioNorm's `log rho_hat = s * (l_new - l_old + b)` per sample `[B]` (carries the graph of the new side)."""
    log_prob_new = promote(log_prob_new)
    old = promote(log_prob_old).detach().to(log_prob_new.dtype)
    b = ratio_bias(mean_new, mean_old, std, mask).to(log_prob_new.dtype)
    s = _per_row(std, log_prob_new).detach()
    return s * (log_prob_new - old + b)


def step_weight(sigma: torch.Tensor | float, sigma_next: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's per-step loss weight `1 / |dt|`, `[B]` (flow_grpo and verl-omni; Flow-Factory leaves it out)."""
    dt = (_per_row(sigma_next, like) - _per_row(sigma, like)).abs()
    if bool((dt <= 0).any()):
        raise ValueError("GRPO-Guard's step weight needs sigma_next != sigma")
    return 1.0 / dt
