"""`build_tiny_cosmos3(out_dir, seed)`: Cosmos3's omni architecture at toy size, built fully offline from a seed.

The result is a normal diffusers Cosmos3OmniPipeline directory (`Cosmos3OmniPipeline.from_pretrained(dir)`
loads it; the safety checker is off in its config, as `cosmos_guardrail` is not installed), plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny.json         metadata: resolution, fps, VAE stats and reconstruction accuracy, params, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  text_tokenizer: a byte-level BPE `Qwen2Tokenizer` with a chat template (`miles.models.cosmos3.tokenizer`);
      Cosmos3 has no text encoder: its language model reads the ids
  transformer: Cosmos3OmniTransformer, 2 mixture-of-transformers layers (an "und" path for text, a "gen" path
      for vision tokens, one shared attention), hidden 256 = 4 query heads x 64 (2 key/value heads), MLPs 512,
      mRoPE sections (12, 10, 10); latent patch 8: ONE vision token per latent frame (8 x 8 cells x 2 channels
      = 128 values). Why: as with tiny-wan2_2 (design 2), the DiT has only relative positions (RoPE), and a
      frame-wide patch gives every latent cell its own output row, so the tiny model places the digit from the
      first steps instead of having to self-organise positions; the width holds the patch
  vae: AutoencoderKLWan (Cosmos3's Wan2.2 VAE) at toy size: 8x8 pixel patches (192 channels), no down stage:
      8x spatial, 1x temporal; z_dim 2; fitted to the 64x64 digits as one-frame videos (one latent cell per
      digit pixel); per-channel latents_mean/latents_std from the posterior means. Videos run through it (each
      frame its own latent frame) but it is fitted to still images only
  scheduler: UniPCMultistepScheduler with flow sigmas at flow_shift 5 (multistep, so not a Gaussian step: miles'
      rollouts step Euler on the same sigma grid, as sglang does)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import DigitFramesBuild
from miles.builtin.tiny.video_vae import decode_unclamped, make_wan_vae
from miles.models.tiny.metadata import FORMAT_VERSION, current_design

__all__ = ["TINY_COSMOS3_NAME", "BuildReport", "build_tiny_cosmos3"]

TINY_COSMOS3_NAME = "tiny-cosmos3"

# the language model / denoiser
HIDDEN = 256
HEAD_DIM = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE = 512
NUM_LAYERS = 2
ROPE_AXES = (12, 10, 10)  # sums to HEAD_DIM / 2

# the VAE (Wan2.2's class)
LATENT_CHANNELS = 2
VAE_BASE_DIM = 16
VAE_PIXEL_PATCH = 8
SPATIAL_COMPRESSION = VAE_PIXEL_PATCH  # no down stage
TEMPORAL_COMPRESSION = 1
VAE_STEPS = 300
VAE_BATCH_SIZE = 16
VAE_LR = 1e-2
VAE_INIT_LOGVAR = -6.0  # small posterior noise at init (see tiny-wan2_2)

RESOLUTION = 64
LATENT_SIZE = RESOLUTION // SPATIAL_COMPRESSION
LATENT_PATCH = LATENT_SIZE  # one token per latent frame
FPS = 8.0
NUM_FRAMES = 9  # the video size the tokenizer's corpus covers (the VAE is fitted to images)

SEED_OFFSETS = {"transformer": 4, "vae": 5}

SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 5.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}


def make_tokenizer() -> Any:
    from miles.models.cosmos3.tokenizer import build_cosmos3_tokenizer

    return build_cosmos3_tokenizer(sizes=(RESOLUTION,), frames=(NUM_FRAMES,), fps=(FPS,))


def make_transformer(seed: int, vocab_size: int) -> Any:
    """The tiny `Cosmos3OmniTransformer` (random; training learns it)."""
    from diffusers import Cosmos3OmniTransformer

    seeded(seed, "transformer", SEED_OFFSETS)
    return Cosmos3OmniTransformer(
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        latent_channel=LATENT_CHANNELS,
        latent_patch_size=LATENT_PATCH,
        num_attention_heads=NUM_HEADS,
        num_hidden_layers=NUM_LAYERS,
        num_key_value_heads=NUM_KV_HEADS,
        patch_latent_dim=LATENT_CHANNELS * LATENT_PATCH * LATENT_PATCH,
        vocab_size=vocab_size,
        rope_axes_dim=list(ROPE_AXES),
        # sglang's port reads the sections only from here (else its default 24/20/20); diffusers reads
        # rope_axes_dim first, so both engines rotate by the same sections
        rope_scaling={"mrope_section": list(ROPE_AXES)},
        dtype="float32",
    )


def make_vae(seed: int) -> Any:
    """The tiny `AutoencoderKLWan` (latents_mean/std are placeholders until `set_latents_mean_std`)."""
    return make_wan_vae(
        seed,
        SEED_OFFSETS,
        base_dim=VAE_BASE_DIM,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1],
        temporal_downsample=[],
        pixel_patch=VAE_PIXEL_PATCH,
        temporal_compression=TEMPORAL_COMPRESSION,
        spatial_compression=SPATIAL_COMPRESSION,
        init_logvar=VAE_INIT_LOGVAR,
    )


def make_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**SCHEDULER_CONFIG)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them
    ({component: those keys of its config}), so `miles inspect-config` shows the grid before the first build."""
    return {
        "scheduler": {"_class_name": "UniPCMultistepScheduler", **SCHEDULER_CONFIG},
        "vae": {
            "scale_factor_spatial": SPATIAL_COMPRESSION,
            "scale_factor_temporal": TEMPORAL_COMPRESSION,
            "z_dim": LATENT_CHANNELS,
        },
    }


def make_pipeline(transformer: Any, tokenizer: Any, vae: Any) -> Any:
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=make_scheduler(),
        enable_safety_checker=False,
    )


class TinyCosmos3Build(DigitFramesBuild):
    """tiny-cosmos3's phases: its tokenizer (the language model reads token ids: no text encoder), the omni
    transformer, a Wan VAE with an 8x pixel patch fitted to one-frame digits."""

    name = TINY_COSMOS3_NAME

    def tokenizers(self) -> None:
        self.tokenizer = make_tokenizer()

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed, len(self.tokenizer))

    def make_vae(self) -> Any:
        return make_vae(self.seed)

    def fit_options(self) -> dict[str, Any]:
        return {"batch_size": VAE_BATCH_SIZE, "lr": VAE_LR, "decode": decode_unclamped}

    def pipeline(self) -> Any:
        return make_pipeline(self.dit, self.tokenizer, self.vae)

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.data.digits import PROMPT_TEMPLATE, SPLIT_SEED

        return {
            "name": TINY_COSMOS3_NAME,
            "format_version": FORMAT_VERSION,
            "design": current_design(TINY_COSMOS3_NAME),
            "seed": self.seed,
            "resolution": RESOLUTION,
            "fps": FPS,
            "latent_size": LATENT_SIZE,
            "latent_channels": LATENT_CHANNELS,
            "flow_shift": SCHEDULER_CONFIG["flow_shift"],
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits", "split_seed": SPLIT_SEED},
            "tokenizer": {"vocab_size": len(self.tokenizer)},
            "vae": {
                "latents_mean": self.latents_mean,
                "latents_std": self.latents_std,
                "spatial_compression": SPATIAL_COMPRESSION,
                "temporal_compression": TEMPORAL_COMPRESSION,
                **self.vae_fit_fields(VAE_BATCH_SIZE, VAE_LR),
            },
            "digit_classifier": {"path": "digit_classifier", "test_accuracy": report.classifier_test_accuracy},
        }


def build_tiny_cosmos3(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-cosmos3 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyCosmos3Build.build(out_dir, seed, progress, vae_steps)
