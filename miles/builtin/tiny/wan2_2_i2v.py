"""`build_tiny_wan2_2_i2v(out_dir, seed)`: Wan2.2-I2V-A14B's layout at tiny-wan2_2's toy size, built offline.

tiny-wan2_2's components, sizes and seeds (`miles.builtin.tiny.wan2_2`: the tokenizer with the moving-digit
words, the UMT5 encoder, the Wan VAE with 4x4 pixel patches fitted to the moving digits, UniPC as the hub ships
it, the video digit classifier), saved as a `WanImageToVideoPipeline` without an image encoder (as
Wan2.2-I2V-A14B-Diffusers), except the two experts: their input takes the first frame's condition on the channels,
`in_channels = 2 z + T` = 2 + 1 + 2 = 5 (the latents, the mask's T channels, the first frame's latents; the real
A14B: 16 + 4 + 16 = 36), `out_channels = z` = 2; and the expert boundary is A14B I2V's `boundary_ratio` 0.9.
The experts are random (training learns them). The directory appears atomically, with `miles_tiny.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.wan2_2 import (
    LATENT_CHANNELS,
    PATCH_SIZE,
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

__all__ = ["TINY_WAN2_2_I2V_NAME", "BuildReport", "build_tiny_wan2_2_i2v", "make_scheduler", "make_vae"]

TINY_WAN2_2_I2V_NAME = "tiny-wan2_2-i2v"
SGLANG_MODEL_ID = "Wan2.2-I2V-A14B-Diffusers"
BOUNDARY_RATIO = 0.9  # Wan2.2-I2V-A14B's
MASK_CHANNELS = TEMPORAL_COMPRESSION  # the first-frame mask's channels: the VAE's temporal factor
IN_CHANNELS = 2 * LATENT_CHANNELS + MASK_CHANNELS


def make_transformer(seed: int, name: str = "transformer") -> Any:
    """One tiny I2V expert (random): tiny-wan2_2's, with `IN_CHANNELS` input channels."""
    return make_wan_transformer(seed, name, in_channels=IN_CHANNELS)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid reads, as this build writes them (see tiny-wan2_2's)."""
    expert = {"patch_size": list(PATCH_SIZE), "in_channels": IN_CHANNELS, "out_channels": LATENT_CHANNELS}
    return {
        "model_index": {"boundary_ratio": BOUNDARY_RATIO},
        "scheduler": {"_class_name": "UniPCMultistepScheduler", **SCHEDULER_CONFIG},
        "vae": {
            "scale_factor_spatial": SPATIAL_COMPRESSION,
            "scale_factor_temporal": TEMPORAL_COMPRESSION,
            "z_dim": LATENT_CHANNELS,
        },
        "transformer": dict(expert),
        "transformer_2": dict(expert),
    }


class TinyWan22I2VBuild(TinyWan22Build):
    """tiny-wan2_2's phases; the experts take the first frame on their input channels; saved as a
    WanImageToVideoPipeline without an image encoder."""

    name = TINY_WAN2_2_I2V_NAME

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed, "transformer")
        self.dit_2 = make_transformer(self.seed, "transformer_2")

    def pipeline(self) -> Any:
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline(
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            scheduler=make_scheduler(),
            image_processor=None,
            image_encoder=None,
            transformer=self.dit,
            transformer_2=self.dit_2,
            boundary_ratio=BOUNDARY_RATIO,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        return {
            **super().metadata(report),
            "name": TINY_WAN2_2_I2V_NAME,
            "design": current_design(TINY_WAN2_2_I2V_NAME),
            "boundary_ratio": BOUNDARY_RATIO,
            "sglang_model_id": SGLANG_MODEL_ID,
            "condition": {"images": 1, "mask_channels": MASK_CHANNELS, "in_channels": IN_CHANNELS},
        }


def build_tiny_wan2_2_i2v(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-wan2_2-i2v into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyWan22I2VBuild.build(out_dir, seed, progress, vae_steps)
