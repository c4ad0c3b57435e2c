"""DiffusionNFT (`--loss-type nft`) as implemented in NVlabs/DiffusionNFT scripts/train_nft_sd3.py (algorithms.md C.2).

Per train pair (clean latent x0, its group advantage A, a trained sigma t, fresh noise)::

    x_t    = (1 - t) * x0 + t * noise                                   # nft_corrupt
    r      = clamp(clamp(A, -c, c) / c / 2 + 0.5, 0, 1)                 # c = --diffusion-adv-clip-max
    v_pos  = beta * v_new + (1 - beta) * sg(v_old)                      # beta = --diffusion-nft-beta
    v_neg  = (1 + beta) * sg(v_old) - beta * v_new
    x0_pm  = x_t - t * v_pm
    adaptive (default):  w_pm = sg(clamp_min(mean_CHW|x0_pm - x0|, 1e-5)),  L_pm = mean_CHW((x0_pm - x0)**2) / w_pm
    else (--no-diffusion-nft-adaptive-weight):  L_pm = mean_CHW((x0_pm - x0)**2)
    per    = (r * L_pos / beta + (1 - r) * L_neg / beta) * c
    kl     = mean_CHW((v_new - sg(v_ref))**2)
    loss   = mean_b(per) + kl_beta * mean_b(kl)                         # kl_beta = --diffusion-kl-beta

With a `mask` (the family's `generated_mask`, e.g. Wan2.2 TI2V without its condition frame) every mean_CHW is over
the masked elements only.

`v_new` is the trained policy's velocity, `v_old` the sampling policy's (pi_old: the EMA under
`--ref-mode ema`), `v_ref` the reference's; all three are predicted at the same `x_t` without CFG. The
factor `c` multiplies the whole policy term (the reference's `policy_loss = (ori_policy_loss * adv_clip_max).mean()`).

Timesteps (`nft_timesteps`): the rollout's sigmas without the terminal 0; each sample takes a random
permutation (shuffle on) or the schedule order (shuffle off) and keeps the first `max(1, int(T * fraction))`,
so with 10 steps and fraction 0.99 every sample trains 9 distinct sigmas and both sigma = 1 and the smallest
sigma can appear (algorithms.md C.3, D.8.7).
"""

from __future__ import annotations

import torch

from miles.algorithms.sft_loss import batch_view, mean_non_batch, noisy_latents, promote

__all__ = ["ADAPTIVE_WEIGHT_MIN", "nft_corrupt", "nft_loss", "nft_optimality", "nft_timesteps"]

ADAPTIVE_WEIGHT_MIN = 1e-5

Scalar = float | int | torch.Tensor


def nft_corrupt(x0: torch.Tensor, t: Scalar, noise: torch.Tensor) -> torch.Tensor:
    """Forward noising `(1 - t) * x0 + t * noise` (t = sigma: a number, 0-d or `[B]`)."""
    return noisy_latents(x0, noise, t)


def nft_optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """The optimality probability `r = clamp(clamp(A, -c, c) / c / 2 + 0.5, 0, 1)`: A = 0 -> 0.5, A = +-c -> 1 / 0."""
    if adv_clip_max <= 0:
        raise ValueError(f"--diffusion-adv-clip-max must be > 0 under nft, got {adv_clip_max}")
    a = torch.clamp(promote(advantages), -adv_clip_max, adv_clip_max)
    return torch.clamp(a / adv_clip_max / 2 + 0.5, 0.0, 1.0)


def nft_timesteps(
    sigmas: torch.Tensor,
    fraction: float = 0.99,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    *,
    batch: int | None = None,
) -> torch.Tensor:
    """The trained sigmas of each sample.

    sigmas    the rollout schedule, `[T+1]` with a terminal 0 or `[T]`, shared by the batch; or per sample
              `[B, T+1]` / `[B, T]`. A trailing all-zero column (the terminal sigma) is dropped.
    fraction  `--diffusion-nft-timestep-fraction`: K = max(1, int(T * fraction)) sigmas are kept
    shuffle   per-sample random order (independent permutations, drawn from `generator`); off: schedule order
    batch     for a 1-D `sigmas`, the number of samples; None returns a single `[K]` row

    Returns `[B, K]` (or `[K]`), on `sigmas`' device and dtype.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"--diffusion-nft-timestep-fraction must be in (0, 1], got {fraction}")
    s = torch.as_tensor(sigmas)
    if s.ndim not in (1, 2):
        raise ValueError(f"sigmas must be [T(+1)] or [B, T(+1)], got {tuple(s.shape)}")
    single = s.ndim == 1 and batch is None
    if s.ndim == 1:
        s = s.unsqueeze(0).expand(1 if batch is None else batch, -1)
    elif batch is not None and batch != s.shape[0]:
        raise ValueError(f"batch={batch} does not match sigmas {tuple(s.shape)}")
    if s.shape[1] > 0 and bool((s[:, -1] == 0).all()):
        s = s[:, :-1]
    num = s.shape[1]
    if num == 0:
        raise ValueError("sigmas has no non-terminal step")
    k = max(1, int(num * fraction))
    if shuffle:
        gen_device = generator.device if generator is not None else "cpu"
        order = torch.rand(s.shape[0], num, generator=generator, device=gen_device).argsort(dim=1).to(s.device)
    else:
        order = torch.arange(num, device=s.device).expand(s.shape[0], -1)
    out = torch.gather(s, 1, order[:, :k])
    return out[0] if single else out


def _mean_d(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per-sample mean over the non-batch dims (over the `mask` elements only when given)."""
    if mask is None:
        return mean_non_batch(t)
    return t.flatten(1)[:, mask.to(t.device).flatten()].mean(dim=1)


def _mean_all(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over every element (over the `mask` elements of each sample only when given)."""
    return t.mean() if mask is None else _mean_d(t, mask).mean()


def _x0_loss(x0_hat: torch.Tensor, x0: torch.Tensor, adaptive: bool, mask: torch.Tensor | None) -> torch.Tensor:
    sq = _mean_d((x0_hat - x0) ** 2, mask)
    if not adaptive:
        return sq
    with torch.no_grad():
        w = _mean_d((x0_hat - x0).abs(), mask).clamp_min(ADAPTIVE_WEIGHT_MIN)
    return sq / w


def nft_loss(
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: Scalar,
    v_new: torch.Tensor,
    v_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    adaptive_weight: bool = True,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT loss and diagnostics (formulas in the module docstring).

    x0          clean latents `[B, ...]` (data, detached)
    x_t         `nft_corrupt(x0, t, noise)`, the input of all three predictions, `[B, ...]`
    t           sigma per sample (`[B]`, 0-d or a number)
    v_new       trained velocity `[B, ...]` (carries the graph)
    v_old       pi_old / EMA velocity `[B, ...]` (detached here)
    advantages  `[B]` group advantages
    beta        `--diffusion-nft-beta` (> 0)
    adv_clip_max  `--diffusion-adv-clip-max` c (> 0): clamp, r slope and the loss scale
    adaptive_weight  not `--no-diffusion-nft-adaptive-weight`
    v_ref, kl_beta   optional KL to the reference velocity; kl_beta > 0 requires v_ref
    mask        optional bool tensor of one sample's shape (the family's `generated_mask`): the means read only
                its True elements (None: all)

    Metrics: loss, policy_loss, kl_loss, positive_loss, negative_loss, r_mean, adv_abs_mean,
    fm_x0_mse (mean((x_t - t*v_new - x0)**2), the plain flow-matching error of the trained policy) and
    old_deviation (mean((v_new - v_old)**2)).
    """
    if beta <= 0:
        raise ValueError(f"--diffusion-nft-beta must be > 0, got {beta}")
    if kl_beta < 0:
        raise ValueError(f"--diffusion-kl-beta must be >= 0, got {kl_beta}")
    for name, tensor in (("x_t", x_t), ("v_new", v_new), ("v_old", v_old)):
        if tensor.shape != x0.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match x0 {tuple(x0.shape)}")
    v_new = promote(v_new)
    dtype = v_new.dtype
    x0 = promote(x0).detach().to(dtype)
    x_t = promote(x_t).detach().to(dtype)
    v_old = promote(v_old).detach().to(dtype)
    tt = batch_view(t, x0).to(dtype)
    adv = promote(advantages).detach().to(device=x0.device, dtype=dtype).reshape(-1)
    if adv.shape[0] != x0.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [{x0.shape[0]}]")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(x0.shape[1:])):
        raise ValueError(f"mask must be a bool tensor of one sample's shape {tuple(x0.shape[1:])}")
    r = nft_optimality(adv, adv_clip_max)

    v_pos = beta * v_new + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_new
    loss_pos = _x0_loss(x_t - tt * v_pos, x0, adaptive_weight, mask)
    loss_neg = _x0_loss(x_t - tt * v_neg, x0, adaptive_weight, mask)
    per = (r * loss_pos / beta + (1 - r) * loss_neg / beta) * adv_clip_max
    pol = per.mean()

    kl = None
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError(
                "the NFT KL (--diffusion-kl-beta > 0) needs a reference velocity: set --ref-mode lora_base or ema"
            )
        if v_ref.shape != x0.shape:
            raise ValueError(f"v_ref {tuple(v_ref.shape)} must match x0 {tuple(x0.shape)}")
        kl = _mean_d((v_new - promote(v_ref).detach().to(dtype)) ** 2, mask).mean()
        loss = pol + kl_beta * kl
    else:
        loss = pol
        if v_ref is not None:
            with torch.no_grad():
                kl = _mean_d((v_new.detach() - promote(v_ref).to(dtype)) ** 2, mask).mean()

    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "policy_loss": float(pol),
            "kl_loss": float(kl) if kl is not None else 0.0,
            "positive_loss": float(loss_pos.mean()),
            "negative_loss": float(loss_neg.mean()),
            "r_mean": float(r.mean()),
            "adv_abs_mean": float(torch.clamp(adv, -adv_clip_max, adv_clip_max).abs().mean()),
            "fm_x0_mse": float(_mean_all((x_t - tt * v_new - x0) ** 2, mask)),
            "old_deviation": float(_mean_all((v_new - v_old) ** 2, mask)),
        }
    return loss, metrics
