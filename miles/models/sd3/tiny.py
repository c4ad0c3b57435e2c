"""`build_tiny_sd3(out_dir, seed)`: the embedded default checkpoint, fully offline and seeded.

The result is a normal diffusers StableDiffusion3Pipeline directory (three text encoders, so
sglang-diffusion's native SD3 pipeline can serve it too), plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny_sd3.json     metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from miles.models.loading import quiet_loading
from miles.models.tiny import components as C
from miles.models.tiny.build import (
    BuildReport,
    Progress,
    build_atomically,
    finish_image_build,
    fit_digits_image_vae,
    phase_timer,
)
from miles.models.tiny.metadata import (
    METADATA_FILE,
    TINY_SD3_NAME,
)
from miles.models.tiny.vae_fit import VAE_STEPS

SGLANG_MODEL_ID = "stable-diffusion-3-medium-diffusers"  # the model id sglang's native SD3 pipeline knows


class _SD3Progress(Progress):
    label = TINY_SD3_NAME


def build_tiny_sd3(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-sd3 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return build_atomically(out_dir, lambda tmp: _build_into(tmp, seed, progress, vae_steps))


def _build_into(tmp: Path, seed: int, progress: bool, vae_steps: int) -> BuildReport:
    start = time.perf_counter()
    timings: dict[str, float] = {}

    with _SD3Progress(progress, vae_steps) as bar:
        phase = phase_timer(timings, bar)
        with phase("tokenizers"):
            from miles.models.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

            clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
            ids = {
                "clip_vocab_size": len(clip_tok),
                "clip_bos_id": clip_tok.bos_token_id,
                "clip_eos_id": clip_tok.eos_token_id,
                "clip_pad_id": clip_tok.pad_token_id,
                "t5_vocab_size": len(t5_tok),
                "t5_pad_id": t5_tok.pad_token_id,
                "t5_eos_id": t5_tok.eos_token_id,
            }
        with phase("text encoders"):
            te1 = C.make_clip_text_encoder(seed, "text_encoder", ids)
            te2 = C.make_clip_text_encoder(seed, "text_encoder_2", ids)
            te3 = C.make_t5_encoder(seed, ids)
        with phase("transformer"):
            transformer = make_transformer(seed)
        fit = fit_digits_image_vae(phase, bar, tmp, seed, vae_steps)
        vae = fit.vae
        with phase("save"):
            from diffusers import StableDiffusion3Pipeline

            pipe = StableDiffusion3Pipeline(
                transformer=transformer,
                scheduler=make_scheduler(),
                vae=vae,
                text_encoder=te1,
                tokenizer=clip_tok,
                text_encoder_2=te2,
                tokenizer_2=clip_tok,
                text_encoder_3=te3,
                tokenizer_3=t5_tok,
            )
            with quiet_loading():
                pipe.save_pretrained(tmp)
        report = finish_image_build(
            pipe,
            tmp,
            name=TINY_SD3_NAME,
            seed=seed,
            vae_steps=vae_steps,
            fit=fit,
            start=start,
            timings=timings,
            sglang_model_id=SGLANG_MODEL_ID,
            metadata_file=METADATA_FILE,
        )
        bar.describe("done")
    return report


def make_transformer(seed: int) -> Any:
    from diffusers import SD3Transformer2DModel

    C.seeded(seed, "transformer")
    return SD3Transformer2DModel(
        sample_size=C.LATENT_SIZE,
        patch_size=2,
        in_channels=C.LATENT_CHANNELS,
        out_channels=C.LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=C.JOINT_ATTENTION_DIM,
        caption_projection_dim=64,
        pooled_projection_dim=C.POOLED_PROJECTION_DIM,
        pos_embed_max_size=16,
    )


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
