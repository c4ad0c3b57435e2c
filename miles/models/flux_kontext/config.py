"""The `flux_kontext` family: FLUX.1 Kontext, image editing on the FLUX.1 DiT (`FluxKontextPipeline`).

Torch-free at import. Everything of `flux` holds (packed 2x2 latents, embedded guidance, t/1000, the dynamic shift
from the *generated* token count); what Kontext adds is one source image per prompt row:
  * the source is encoded by the VAE (posterior mode, FLUX's shift and scale) and packed like the latents:
    `ref_tokens` [1, N_ref, 4C], with its latent grid `ref_grid` [1, 2] = (h_ref, w_ref) (recorded as floats, as
    every condition);
  * every step runs the DiT on `[pack(x_t) ; ref_tokens]` with RoPE ids `(0, r, c)` for the generated tokens and
    `(1, r, c)` for the source's, and keeps the first `N_gen` outputs: the source tokens are inputs only, never
    noised, stepped, in a log-prob or in a loss;
  * the source keeps its own size, each side rounded down to a multiple of 16 pixels (`FluxKontextPipeline` with
    `_auto_resize=False`; its default snaps the source to one of Kontext's ~1 MP training buckets: give sources
    at those sizes for a real checkpoint).
Both branches of a true-CFG pair see the same source tokens, as in the pipeline.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import register_train_pipeline_config
from miles.models.flux.config import FluxTrainPipelineConfig, latent_image_ids, pack_latents, unpack_latents


def source_grid(grid: Any, tokens: int, output_grid: tuple[int, int]) -> tuple[int, int]:
    """A source's latent grid (h, w), read from its recorded `ref_grid`. Under the memory plan's trace (fake or meta
    tensors, whose values cannot be read) it is the output's grid when the source has as many packed tokens, which
    is the plan's example (`example_media_conditions`: a source the size of the output); otherwise a ValueError."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(grid) or grid.device.type == "meta":
        h, w = output_grid
        if tokens != (h // 2) * (w // 2):
            raise ValueError(f"a traced source of {tokens} packed tokens: only a source the output's size is traced")
        return h, w
    h, w = (int(v) for v in grid.reshape(-1, 2)[0].tolist())
    return h, w


def reference_image_ids(grid: tuple[int, int], device: Any, dtype: Any) -> Any:
    """RoPE positions of a source's packed tokens: its latent grid's (h, w) ids with axis 0 set to 1."""
    ids = latent_image_ids(*grid, device, dtype)
    ids[:, 0] = 1
    return ids


@register_train_pipeline_config("flux_kontext")
class FluxKontextTrainPipelineConfig(FluxTrainPipelineConfig):
    description = "FLUX.1 Kontext image editing (FLUX.1 DiT, the source image's packed tokens in the sequence)"
    hf_ckpt_name_patterns = ("kontext", "flux.1-kontext", "tiny-flux-kontext")
    pipeline_class = "diffusers.FluxKontextPipeline"
    condition_inputs = ("encoder_hidden_states", "pooled_projections", "guidance", "ref_tokens", "ref_grid")
    condition_images = (1, 1)
    sglang_model_id = "FLUX.1-Kontext-dev"
    sglang_unserved = (
        "miles does not send condition images to sglang-diffusion yet (whether its server returns Kontext "
        "trajectories is unverified); the in-process engine serves it"
    )

    def encode_media(self, pipe: Any, images: list[Any], height: int, width: int) -> dict[str, Any]:
        """The source at its own size (sides rounded down to a multiple of 2x the VAE factor), preprocessed as the
        pipeline does, its VAE mode shifted and scaled, packed; and its latent grid."""
        import torch

        (image,) = images
        multiple = pipe.vae_scale_factor * 2
        w, h = image.size
        h, w = h // multiple * multiple, w // multiple * multiple
        if h == 0 or w == 0:
            raise ValueError(f"a source image of {image.size[0]}x{image.size[1]} is under {multiple} pixels a side")
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w)
        vae = pipe.vae
        pixels = pixels.to(device=vae.device, dtype=vae.dtype)
        latents = vae.encode(pixels).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        grid = torch.tensor([[latents.shape[-2], latents.shape[-1]]], dtype=torch.int64, device=latents.device)
        return {"ref_tokens": pack_latents(latents), "ref_grid": grid}

    def forward_velocity(self, transformer: Any, latents: Any, timestep: Any, cond: dict[str, Any]) -> Any:
        """FLUX's forward on the generated tokens followed by the source's; the generated part of the output."""
        import torch

        h, w = int(latents.shape[-2]), int(latents.shape[-1])
        text = cond["encoder_hidden_states"]
        ref = cond["ref_tokens"].to(latents.dtype)
        tokens = pack_latents(latents)
        n_gen = tokens.shape[1]
        grid = source_grid(cond["ref_grid"], ref.shape[1], (h, w))
        own = latent_image_ids(h, w, latents.device, latents.dtype)
        ids = torch.cat([own, reference_image_ids(grid, latents.device, latents.dtype)])
        guidance = cond.get("guidance") if transformer.config.guidance_embeds else None
        out = transformer(
            hidden_states=torch.cat([tokens, ref], dim=1),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None if guidance is None else guidance.to(torch.float32),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, :n_gen], h, w)

    def example_media_conditions(self, latent_shape: tuple[int, ...], pipe: Any = None) -> dict[str, Any]:
        """A source the size of the output (as many packed tokens as the generated image): the memory plan's case
        of an edit at the output's resolution."""
        c, h, w = latent_shape[-3:]
        return {"ref_tokens": (((h // 2) * (w // 2), 4 * c), None), "ref_grid": ((2,), "float32")}
