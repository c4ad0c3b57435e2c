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
      for vision tokens, one shared attention), hidden 512 = 8 query heads x 64 (4 key/value heads), MLPs 1024,
      mRoPE sections (12, 10, 10); latent patch 8: ONE vision token per latent frame (8 x 8 cells x 4 channels
      = 256 values). Why: as with tiny-wan2_2 (design 2), the DiT has only relative positions (RoPE), and a
      frame-wide patch gives every latent cell its own output row, so the tiny model places the digit from the
      first steps instead of having to self-organise positions; the width holds the patch
  vae: AutoencoderKLWan (Cosmos3's Wan2.2 VAE) at toy size: 8x8 pixel patches (192 channels), no down stage:
      8x spatial, 1x temporal; z_dim 4; fitted to the 64x64 digits as one-frame videos (one latent cell per
      digit pixel); per-channel latents_mean/latents_std from the posterior means. Videos run through it (each
      frame its own latent frame) but it is fitted to still images only
  scheduler: UniPCMultistepScheduler with flow sigmas at flow_shift 5 (multistep, so not a Gaussian step: miles'
      rollouts step Euler on the same sigma grid, as sglang does)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles.models.loading import quiet_loading
from miles.models.tiny.build import (
    BuildReport,
    Progress,
    build_atomically,
    library_versions,
    phase_timer,
    pipeline_report,
    score_and_save_classifier,
)
from miles.models.tiny.metadata import FORMAT_VERSION, TINY_METADATA_FILE, current_design

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


class _Cosmos3Progress(Progress):
    label = TINY_COSMOS3_NAME


def _seeded(seed: int, name: str) -> None:
    import torch

    torch.manual_seed(seed * 1000 + SEED_OFFSETS[name])


def make_tokenizer() -> Any:
    from miles.models.cosmos3.tokenizer import build_cosmos3_tokenizer

    return build_cosmos3_tokenizer(sizes=(RESOLUTION,), frames=(NUM_FRAMES,), fps=(FPS,))


def make_transformer(seed: int, vocab_size: int) -> Any:
    """The tiny `Cosmos3OmniTransformer` (random; training learns it)."""
    from diffusers import Cosmos3OmniTransformer

    _seeded(seed, "transformer")
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
    import torch
    from diffusers import AutoencoderKLWan

    _seeded(seed, "vae")
    channels = 3 * VAE_PIXEL_PATCH**2
    vae = AutoencoderKLWan(
        base_dim=VAE_BASE_DIM,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1],
        num_res_blocks=1,
        temperal_downsample=[],
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
        in_channels=channels,
        out_channels=channels,
        patch_size=VAE_PIXEL_PATCH,
        scale_factor_temporal=TEMPORAL_COMPRESSION,
        scale_factor_spatial=SPATIAL_COMPRESSION,
    )
    with torch.no_grad():
        vae.quant_conv.bias[LATENT_CHANNELS:] = VAE_INIT_LOGVAR
    return vae


def make_scheduler() -> Any:
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**SCHEDULER_CONFIG)


def make_pipeline(transformer: Any, tokenizer: Any, vae: Any) -> Any:
    from diffusers import Cosmos3OmniPipeline

    return Cosmos3OmniPipeline(
        transformer=transformer,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=make_scheduler(),
        enable_safety_checker=False,
    )


def build_tiny_cosmos3(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-cosmos3 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return build_atomically(out_dir, lambda tmp: _build_into(tmp, seed, progress, vae_steps))


def _build_into(tmp: Path, seed: int, progress: bool, vae_steps: int) -> BuildReport:
    start = time.perf_counter()
    timings: dict[str, float] = {}

    with _Cosmos3Progress(progress, vae_steps) as bar:
        phase = phase_timer(timings, bar)
        with phase("tokenizers"):
            tokenizer = make_tokenizer()
        with phase("text encoders"):
            pass  # none: the language model reads token ids
        with phase("transformer"):
            transformer = make_transformer(seed, len(tokenizer))
        with phase("data"):
            import torch

            from miles.data.digits import load_digits_split
            from miles.models.qwen_image.tiny import digits_to_video_input
            from miles.models.tiny import vae_fit
            from miles.models.wan2_2.tiny import decode_unclamped

            split = load_digits_split()
            train_images = digits_to_video_input(split.train_x)  # one-frame videos [N, 3, 1, 64, 64]
            test_images = digits_to_video_input(split.test_x)
        with phase("vae fit", advance=False):
            vae = make_vae(seed)
            on_step: Callable[[int, float], None] = lambda step, loss: bar.advance()  # noqa: E731
            vae_fit.fit_vae(
                vae,
                train_images,
                steps=vae_steps,
                batch_size=VAE_BATCH_SIZE,
                lr=VAE_LR,
                seed=seed,
                on_step=on_step,
                decode=decode_unclamped,
            )
        with phase("vae stats"):
            latents_mean, latents_std = vae_fit.set_latents_mean_std(vae, train_images)
            recon = vae_fit.reconstruct(vae, test_images)
            vae_mse = float(torch.nn.functional.mse_loss(recon, test_images))
        with phase("classifier"):
            clf_meta, recon_acc = score_and_save_classifier(tmp, recon[:, :, 0], split.test_y)
        with phase("save"):
            pipe = make_pipeline(transformer, tokenizer, vae)
            with quiet_loading():
                pipe.save_pretrained(tmp)
        report = pipeline_report(pipe, tmp, start, timings, clf_meta["test_accuracy"], vae_mse, recon_acc)
        vae_meta = {
            "latents_mean": latents_mean,
            "latents_std": latents_std,
            "spatial_compression": SPATIAL_COMPRESSION,
            "temporal_compression": TEMPORAL_COMPRESSION,
            "fit_steps": vae_steps,
            "batch_size": VAE_BATCH_SIZE,
            "lr": VAE_LR,
            "test_mse": round(vae_mse, 6),
            "test_reconstruction_accuracy": recon_acc,
        }
        _write_metadata(tmp, seed, {"vocab_size": len(tokenizer)}, vae_meta, report)
        bar.describe("done")
    return report


def _write_metadata(
    out: Path, seed: int, tokens: dict[str, int], vae_meta: dict[str, Any], report: BuildReport
) -> None:
    from miles.data.digits import PROMPT_TEMPLATE, SPLIT_SEED

    meta = {
        "name": TINY_COSMOS3_NAME,
        "format_version": FORMAT_VERSION,
        "design": current_design(TINY_COSMOS3_NAME),
        "seed": seed,
        "resolution": RESOLUTION,
        "fps": FPS,
        "latent_size": LATENT_SIZE,
        "latent_channels": LATENT_CHANNELS,
        "flow_shift": SCHEDULER_CONFIG["flow_shift"],
        "prompt_template": PROMPT_TEMPLATE,
        "data": {"name": "digits", "split_seed": SPLIT_SEED},
        "tokenizer": tokens,
        "vae": vae_meta,
        "digit_classifier": {"path": "digit_classifier", "test_accuracy": report.classifier_test_accuracy},
        "params": report.params,
        "build_seconds": report.seconds,
        "phase_seconds": report.phase_seconds,
        "versions": library_versions(),
    }
    (out / TINY_METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
