"""What the video tiny builds share: the moving-digit prompts, the digits as one-frame videos, Wan's VAE class at
toy size and its unclamped decode (the fit's reconstruction). Torch and diffusers are imported on use."""

from __future__ import annotations

from typing import Any

from miles.builtin.tiny.components import seeded


def video_prompts() -> list[str]:
    """Every moving-digit prompt (digit x direction): the words a video build's tokenizer must know."""
    from miles.data.digits import NUM_LABELS
    from miles.data.digits_video import DIRECTIONS, prompt_for

    return [prompt_for(k, d) for k in range(NUM_LABELS) for d in DIRECTIONS]


def digits_to_video_input(x8: Any) -> Any:
    """(N, 8, 8) numpy digits in [0, 1] -> (N, 3, 1, 64, 64) float32 1-frame videos in [-1, 1]."""
    from miles.builtin.tiny.vae_fit import digits_to_vae_input

    return digits_to_vae_input(x8)[:, :, None].contiguous()


def make_wan_vae(
    seed: int,
    offsets: dict[str, int],
    *,
    base_dim: int,
    z_dim: int,
    dim_mult: list[int],
    temporal_downsample: list[bool],
    pixel_patch: int,
    temporal_compression: int,
    spatial_compression: int,
    init_logvar: float,
) -> Any:
    """A tiny `AutoencoderKLWan` (tiny-wan2_2's, tiny-cosmos3's), seeded from `offsets["vae"]`: latents_mean/std
    are placeholders until `set_latents_mean_std`; the posterior's log-variance channels start at `init_logvar`
    (small noise, so the encoder's signal shows from the first step)."""
    import torch
    from diffusers import AutoencoderKLWan

    seeded(seed, "vae", offsets)
    channels = 3 * pixel_patch**2 if pixel_patch > 1 else 3
    vae = AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=dim_mult,
        num_res_blocks=1,
        temperal_downsample=temporal_downsample,
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
        in_channels=channels,
        out_channels=channels,
        patch_size=pixel_patch if pixel_patch > 1 else None,
        scale_factor_temporal=temporal_compression,
        scale_factor_spatial=spatial_compression,
    )
    with torch.no_grad():
        vae.quant_conv.bias[z_dim:] = init_logvar
    return vae


def decode_unclamped(vae: Any, z: Any) -> Any:
    """`vae.decode(z)` before its final clamp to [-1, 1] (the VAE fit's reconstruction).

    Through the clamp, a pixel the decoder pushes below -1 gets no gradient: early in the fit the decoder
    drives nearly every pixel (the digit's too) under -1 to match the black background, and the fit stalls
    there. The decoder's per-latent-frame outputs are collected by a hook, then un-patched as `decode` does.
    """
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    chunks: list[Any] = []
    handle = vae.decoder.register_forward_hook(lambda module, args, out: chunks.append(out))
    try:
        vae.decode(z)
    finally:
        handle.remove()
    out = torch.cat(chunks, dim=2)
    return out if vae.config.patch_size is None else unpatchify(out, patch_size=vae.config.patch_size)
