"""`build_tiny_sd3(out_dir, seed)`: the embedded default checkpoint, fully offline and seeded.

The result is a normal diffusers StableDiffusion3Pipeline directory (three text encoders, so
sglang-diffusion's native SD3 pipeline can serve it too), plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny_sd3.json     metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny import components as C
from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.frame import DigitsImageBuild
from miles.builtin.tiny.vae_fit import VAE_STEPS
from miles.models.tiny.metadata import METADATA_FILE, TINY_SD3_NAME

SGLANG_MODEL_ID = "stable-diffusion-3-medium-diffusers"  # the model id sglang's native SD3 pipeline knows


class TinySD3Build(DigitsImageBuild):
    """tiny-sd3's phases: two CLIP encoders and a T5, the SD3 transformer, the shared digits VAE."""

    name = TINY_SD3_NAME
    metadata_file = METADATA_FILE
    sglang_model_id = SGLANG_MODEL_ID

    def text_encoders(self) -> None:
        self.te1 = C.make_clip_text_encoder(self.seed, "text_encoder", self.ids)
        self.te2 = C.make_clip_text_encoder(self.seed, "text_encoder_2", self.ids)
        self.te3 = C.make_t5_encoder(self.seed, self.ids)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def pipeline(self) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            transformer=self.dit,
            scheduler=make_scheduler(),
            vae=self.vae,
            text_encoder=self.te1,
            tokenizer=self.clip_tok,
            text_encoder_2=self.te2,
            tokenizer_2=self.clip_tok,
            text_encoder_3=self.te3,
            tokenizer_3=self.t5_tok,
        )


def build_tiny_sd3(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-sd3 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinySD3Build.build(out_dir, seed, progress, vae_steps)


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


# the scheduler tiny-sd3 ships (recipes set --diffusion-flow-shift where they want another shift)
SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 1.0}


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them
    ({component: those keys of its config}), so `miles inspect-config` shows the grid before the first build."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"block_out_channels": list(C.VAE_BLOCKS)},
        "transformer": {"in_channels": C.LATENT_CHANNELS},
    }
