"""`build_tiny_flux(out_dir, seed)`: FLUX.1's architecture at toy size, built fully offline from a seed.

The result is a normal diffusers FluxPipeline directory, plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers are imported on use only):
  text_encoder: CLIPTextModel, hidden 32, 2 layers, 4 heads, 77 positions (FLUX uses its pooled
      output, so pooled_projection_dim == 32); tokenizer: tiny-sd3's CLIP BPE
  text_encoder_2: T5EncoderModel, d_model 64 (= joint_attention_dim), 2 layers, 4 heads (tiny-sd3's
      T5, same seed offset); tokenizer_2: tiny-sd3's T5 Unigram
  transformer: FluxTransformer2DModel, 2 double + 2 single blocks, 4 heads x 16 = 64 wide, patch 1
      over 2x2-packed latents (4 channels x 4 = 16 in), RoPE axes (4, 6, 6), guidance embedding;
      random (training learns it)
  vae: tiny-sd3's AutoencoderKL (4 latent channels, 8x spatial), fitted to the 64x64 digits with
      tiny-sd3's VAE fit (same seed -> the same VAE as tiny-sd3), latent shift/scale set
  scheduler: FlowMatchEulerDiscreteScheduler with FLUX.1-dev's config (dynamic, exponential shift)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny import components as C
from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import DigitsImageBuild
from miles.builtin.tiny.vae_fit import VAE_STEPS

__all__ = ["TINY_FLUX_NAME", "BuildReport", "build_tiny_flux"]

TINY_FLUX_NAME = "tiny-flux"
SGLANG_MODEL_ID = "FLUX.1-dev"

CLIP_HIDDEN = C.CLIP_HIDDEN  # == pooled_projection_dim (FluxPipeline feeds CLIPTextModel's pooler_output)
T5_D_MODEL = C.JOINT_ATTENTION_DIM  # 64 == joint_attention_dim
ATTENTION_HEAD_DIM = 16
NUM_ATTENTION_HEADS = 4
AXES_DIMS_ROPE = (4, 6, 6)  # (text/id, row, col); must sum to ATTENTION_HEAD_DIM
PACKED_CHANNELS = C.LATENT_CHANNELS * 4  # FluxPipeline packs 2x2 latent patches into channels

# component -> offset added to the build seed (seed * 1000 + offset), so each init is independent
# of the others' order; text_encoder_2 (3) and vae (5) use tiny-sd3's makers and offsets
SEED_OFFSETS = {"text_encoder": 1, "transformer": 4}

# FLUX.1-dev's scheduler config (resolution-dependent shift)
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
}


def make_clip_text_encoder(seed: int, tok: dict[str, int]) -> Any:
    """FLUX's CLIP-L stand-in: a `CLIPTextModel` (no projection; the pipeline uses its pooled output)."""
    from transformers import CLIPTextModel

    config = C.clip_text_config(tok)
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return CLIPTextModel(config).eval()


def make_transformer(seed: int) -> Any:
    """The tiny `FluxTransformer2DModel` (random; ~0.3M params)."""
    from diffusers import FluxTransformer2DModel

    seeded(seed, "transformer", SEED_OFFSETS)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=PACKED_CHANNELS,
        out_channels=None,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=ATTENTION_HEAD_DIM,
        num_attention_heads=NUM_ATTENTION_HEADS,
        joint_attention_dim=T5_D_MODEL,
        pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=True,
        axes_dims_rope=AXES_DIMS_ROPE,
    )


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them
    ({component: those keys of its config}), so `miles inspect-config` shows the grid before the first build."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"block_out_channels": list(C.VAE_BLOCKS)},  # tiny-sd3's VAE
        "transformer": {"in_channels": PACKED_CHANNELS},
    }


class TinyFluxBuild(DigitsImageBuild):
    """tiny-flux's phases: a CLIP and tiny-sd3's T5, the FLUX transformer, the shared digits VAE."""

    name = TINY_FLUX_NAME
    sglang_model_id = SGLANG_MODEL_ID

    def text_encoders(self) -> None:
        self.te1 = make_clip_text_encoder(self.seed, self.ids)
        self.te2 = C.make_t5_encoder(self.seed, self.ids)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    # the diffusers class the build is saved as (tiny-flux-kontext: FluxKontextPipeline)
    pipeline_class = "FluxPipeline"

    def pipeline(self) -> Any:
        import diffusers

        return getattr(diffusers, self.pipeline_class)(
            transformer=self.dit,
            scheduler=make_scheduler(),
            vae=self.vae,
            text_encoder=self.te1,
            tokenizer=self.clip_tok,
            text_encoder_2=self.te2,
            tokenizer_2=self.t5_tok,
        )


def build_tiny_flux(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-flux into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyFluxBuild.build(out_dir, seed, progress, vae_steps)
