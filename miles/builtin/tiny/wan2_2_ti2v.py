"""`build_tiny_wan2_2_ti2v(out_dir, seed)`: Wan2.2-TI2V-5B's layout at tiny-wan2_2's toy size, built offline.

tiny-wan2_2's components, sizes and seeds (`miles.builtin.tiny.wan2_2`: the tokenizer with the moving-digit words,
the UMT5 encoder, the Wan VAE with 4x4 pixel patches fitted to the moving digits, UniPC as the hub ships it, the
video digit classifier), with ONE transformer and no expert boundary, saved as the hub saves TI2V-5B: a
`WanPipeline` with `expand_timesteps=True` (miles and public callers load it into `WanImageToVideoPipeline`, whose
`expand_timesteps` path holds latent frame 0 at the condition image's latents).
The transformer is not tiny-wan2_2's: `in_channels = out_channels = z` = 2 (the condition is in the latents, not
on the channels; the real TI2V-5B: 48 = 48), and its patch is Wan's (1, 2, 2), 64 tokens a latent frame, because
the pipeline computes the per-token timesteps with a hard-coded 2x2 patch (`first_frame_mask[:, ::2, ::2]`): with
tiny-wan2_2's frame-wide (1, 16, 16) patch the pipeline could not run it (miles' family reads the patch from the
config and could). It is 128 wide (4 heads x 32), 2 layers, random (training learns it).
The directory appears atomically, with `miles_tiny.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.wan2_2 import (
    LATENT_CHANNELS,
    SCHEDULER_CONFIG,
    SPATIAL_COMPRESSION,
    TEMPORAL_COMPRESSION,
    VAE_STEPS,
    TinyWan22Build,
    make_scheduler,
    make_vae,
)
from miles.builtin.tiny.wan2_2 import make_transformer as make_wan_transformer
from miles.models.tiny.metadata import current_design

__all__ = ["TINY_WAN2_2_TI2V_NAME", "BuildReport", "build_tiny_wan2_2_ti2v", "make_scheduler", "make_vae"]

TINY_WAN2_2_TI2V_NAME = "tiny-wan2_2-ti2v"
SGLANG_MODEL_ID = "Wan2.2-TI2V-5B-Diffusers"
PATCH_SIZE = (1, 2, 2)  # Wan's own, the one the pipeline's per-token timesteps assume
NUM_ATTENTION_HEADS = 4
ATTENTION_HEAD_DIM = 32  # RoPE splits it (frame, row, col) = (12, 10, 10)
FFN_DIM = 2 * NUM_ATTENTION_HEADS * ATTENTION_HEAD_DIM


def make_transformer(seed: int) -> Any:
    """The tiny TI2V transformer (random): tiny-wan2_2's first expert's seed, latents in and out (`z` channels),
    Wan's 2x2 patch, 4 heads x 32."""
    return make_wan_transformer(
        seed,
        "transformer",
        patch_size=PATCH_SIZE,
        num_attention_heads=NUM_ATTENTION_HEADS,
        attention_head_dim=ATTENTION_HEAD_DIM,
        ffn_dim=FFN_DIM,
    )


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid reads, as this build writes them (see tiny-wan2_2's)."""
    return {
        "model_index": {"boundary_ratio": None, "expand_timesteps": True},
        "scheduler": {"_class_name": "UniPCMultistepScheduler", **SCHEDULER_CONFIG},
        "vae": {
            "scale_factor_spatial": SPATIAL_COMPRESSION,
            "scale_factor_temporal": TEMPORAL_COMPRESSION,
            "z_dim": LATENT_CHANNELS,
        },
        "transformer": {
            "patch_size": list(PATCH_SIZE),
            "in_channels": LATENT_CHANNELS,
            "out_channels": LATENT_CHANNELS,
        },
    }


class TinyWan22TI2VBuild(TinyWan22Build):
    """tiny-wan2_2's phases; one transformer; saved as a WanPipeline with `expand_timesteps=True`."""

    name = TINY_WAN2_2_TI2V_NAME

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def pipeline(self) -> Any:
        from diffusers import WanPipeline

        return WanPipeline(
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            scheduler=make_scheduler(),
            transformer=self.dit,
            transformer_2=None,
            boundary_ratio=None,
            expand_timesteps=True,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        meta = {
            **super().metadata(report),
            "name": TINY_WAN2_2_TI2V_NAME,
            "design": current_design(TINY_WAN2_2_TI2V_NAME),
            "boundary_ratio": None,
            "expand_timesteps": True,
            "sglang_model_id": SGLANG_MODEL_ID,
            "condition": {"images": 1, "latent_frame": 0, "patch_size": list(PATCH_SIZE)},
        }
        return meta


def build_tiny_wan2_2_ti2v(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-wan2_2-ti2v into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyWan22TI2VBuild.build(out_dir, seed, progress, vae_steps)
