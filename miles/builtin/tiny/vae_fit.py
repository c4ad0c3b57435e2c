"""Fit the tiny AutoencoderKL to reconstruct the upsampled digits, then set its latent shift/scale.

Deterministic for a seed: batches and posterior noise come from a local torch.Generator.
Measured on 2 CPU cores: ~0.06 s/step at batch 8; 300 steps (~18 s) reach a test MSE of ~1.9e-3 in [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

VAE_STEPS = 300
VAE_BATCH_SIZE = 8
VAE_LR = 3e-3
VAE_WARMUP = 20
VAE_KL_WEIGHT = 1e-6


def digits_to_vae_input(x8: Any) -> Any:
    """(N, 8, 8) numpy digits in [0, 1] -> (N, 3, 64, 64) float32 tensor in [-1, 1]."""
    import torch

    from miles.data.digits import upsample_digits

    gray = torch.from_numpy(upsample_digits(x8))
    return (gray * 2.0 - 1.0)[:, None].expand(-1, 3, -1, -1).contiguous()


def fit_vae(
    vae: Any,
    images: Any,
    steps: int = VAE_STEPS,
    batch_size: int = VAE_BATCH_SIZE,
    lr: float = VAE_LR,
    kl_weight: float = VAE_KL_WEIGHT,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    decode: Callable[[Any, Any], Any] | None = None,
) -> float:
    """Train `vae` in place on `images` (N, 3, H, W) in [-1, 1]: MSE + kl_weight * KL, AdamW with
    warm-up then cosine decay, grad clip 1. Returns the last step's loss.

    `decode(vae, z)`: the reconstruction the loss compares (default `vae.decode(z).sample`); a VAE whose
    decode clamps to [-1, 1] passes its unclamped output, so pixels pushed past the range still get gradient."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    loss_value = float("nan")
    with torch.enable_grad():  # callers may hold no_grad (a teacher build encodes its data under it)
        for step in range(steps):
            scale = min(1.0, (step + 1) / VAE_WARMUP) * 0.5 * (1.0 + math.cos(math.pi * step / steps))
            for group in opt.param_groups:
                group["lr"] = lr * scale
            batch = images[torch.randint(0, len(images), (batch_size,), generator=gen)]
            posterior = vae.encode(batch).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
            recon = vae.decode(z).sample if decode is None else decode(vae, z)
            loss = F.mse_loss(recon, batch) + kl_weight * posterior.kl().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            loss_value = float(loss.detach())
            if on_step is not None:
                on_step(step, loss_value)
    vae.eval()
    return loss_value


def encode_mean(vae: Any, images: Any, batch_size: int = 64) -> Any:
    """Posterior means of `images`, unnormalised (before shift/scale)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [vae.encode(images[i : i + batch_size]).latent_dist.mean for i in range(0, len(images), batch_size)]
        )


def set_latent_normalization(vae: Any, images: Any) -> tuple[float, float]:
    """Set `shift_factor` = mean and `scaling_factor` = 1/std of the posterior means over `images`,
    so (z - shift) * scale is zero-mean, unit-variance on the data (SD3's convention)."""
    latents = encode_mean(vae, images).double()
    shift = float(latents.mean())
    scale = float(1.0 / latents.std())
    shift, scale = round(shift, 6), round(scale, 6)
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale


def reconstruct(vae: Any, images: Any, batch_size: int = 64) -> Any:
    """Decode the posterior means (a deterministic round trip), in [-1, 1]-ish pixel space."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [
                vae.decode(vae.encode(images[i : i + batch_size]).latent_dist.mean).sample
                for i in range(0, len(images), batch_size)
            ]
        )


# ---- video VAEs (per-channel latent statistics, moving digits) ------------------------------------
def digit_videos_to_vae_input(x8: Any, num_frames: int | None = None) -> tuple[Any, list[str]]:
    """(N, 8, 8) numpy digits in [0, 1] -> their moving videos, (N, 3, F, 64, 64) float32 in [-1, 1] (gray
    replicated to RGB, a broadcast view), and each video's direction (DIRECTIONS in turn, by index, as the
    video digit classifier is fitted)."""
    import numpy as np
    import torch

    from miles.data.digits_video import DIRECTIONS, NUM_FRAMES, render_video

    frames = num_frames or NUM_FRAMES
    directions = [DIRECTIONS[i % len(DIRECTIONS)] for i in range(len(x8))]
    gray = np.stack([render_video(x, d, frames) for x, d in zip(x8, directions, strict=True)])
    return (torch.from_numpy(gray) * 2.0 - 1.0)[:, None].expand(-1, 3, -1, -1, -1), directions


def set_latents_mean_std(vae: Any, videos: Any, batch_size: int = 64) -> tuple[list[float], list[float]]:
    """Set a video VAE's per-channel `latents_mean` / `latents_std` (Wan / Qwen-Image convention) from the
    posterior means of `videos`, so `(z - mean) / std` is zero-mean, unit-variance per channel on the data."""
    latents = encode_mean(vae, videos, batch_size).double().transpose(0, 1).flatten(1)  # [z_dim, N * F * h * w]
    mean = [round(float(v), 6) for v in latents.mean(dim=1)]
    std = [round(float(v), 6) for v in latents.std(dim=1)]
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return mean, std
