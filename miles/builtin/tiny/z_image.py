"""`build_tiny_z_image(out_dir, seed)`: Z-Image's architecture at toy size, built fully offline from a seed.

The result is a normal diffusers `ZImagePipeline` directory, plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  tokenizer: a byte-level BPE `Qwen2Tokenizer` learned from the digit prompts in Z-Image's chat layout
      (`<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`: `enable_thinking=True` writes no think
      block), with a chat template that writes it
  text_encoder: Qwen3Model, 4 layers of width 32 (2 heads x 16, 1 kv head); the pipeline reads the second-to-last
      hidden state, an inner layer as in the real 36-layer Qwen3; random (never trained)
  transformer: ZImageTransformer2DModel, 2 layers + 1 noise and 1 context refiner, 64 wide (2 heads x 32),
      patch 2 over 4 latent channels, RoPE axes (8, 12, 12); random (training learns it)
  vae: tiny-sd3's AutoencoderKL (4 latent channels, 8x), fitted to the 64x64 digits with tiny-sd3's fit (same seed
      -> the same VAE), latent shift/scale set from the training digits
  scheduler: FlowMatchEulerDiscreteScheduler with a static shift 3 (Z-Image-Turbo's; the base model's 6 would put
      most of 10 steps at high noise on a 16-token image)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny import components as C
from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import DigitsImageBuild
from miles.builtin.tiny.vae_fit import VAE_STEPS

__all__ = ["TINY_Z_IMAGE_NAME", "BuildReport", "build_tiny_z_image"]

TINY_Z_IMAGE_NAME = "tiny-z-image"

TEXT_HIDDEN = 32  # == cap_feat_dim
TEXT_LAYERS = 4
DIM = 64
NUM_HEADS = 2
AXES_DIMS = (8, 12, 12)  # (position, row, col); must sum to DIM / NUM_HEADS
AXES_LENS = (1024, 64, 64)  # caption positions up to 1023 (text padded to 32s), rows and columns
PROMPT_LAYOUT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# chat tokens of a digit prompt (the pipeline drops the padding): 13 for "a handwritten digit 3", the longest corpus
# prompt 15, the empty negative 8; rounded up
MAX_SEQUENCE_LENGTH = 24

SEED_OFFSETS = {"text_encoder": 1, "transformer": 4}

SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def build_tokenizer() -> Any:
    return C.qwen3_chat_tokenizer(PROMPT_LAYOUT)


def make_text_encoder(seed: int, tokenizer: Any) -> Any:
    from transformers import Qwen3Model

    config = C.qwen3_text_config(tokenizer, TEXT_HIDDEN, TEXT_LAYERS)
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return Qwen3Model(config).eval()


def make_transformer(seed: int) -> Any:
    from diffusers import ZImageTransformer2DModel

    seeded(seed, "transformer", SEED_OFFSETS)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=C.LATENT_CHANNELS,
        dim=DIM,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=NUM_HEADS,
        n_kv_heads=NUM_HEADS,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=TEXT_HIDDEN,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=list(AXES_DIMS),
        axes_lens=list(AXES_LENS),
    )


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"block_out_channels": list(C.VAE_BLOCKS)},
        "transformer": {"in_channels": C.LATENT_CHANNELS, "cap_feat_dim": TEXT_HIDDEN},
    }


class TinyZImageBuild(DigitsImageBuild):
    """tiny-z-image's phases: the Qwen tokenizer and text encoder, the Z-Image transformer, the digits VAE."""

    name = TINY_Z_IMAGE_NAME

    def tokenizers(self) -> None:
        self.tokenizer = build_tokenizer()

    def text_encoders(self) -> None:
        self.te = make_text_encoder(self.seed, self.tokenizer)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def pipeline(self) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        return ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
            vae=self.vae,
            text_encoder=self.te,
            tokenizer=self.tokenizer,
            transformer=self.dit,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        return {**super().metadata(report), "max_sequence_length": MAX_SEQUENCE_LENGTH}


def build_tiny_z_image(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-z-image into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyZImageBuild.build(out_dir, seed, progress, vae_steps)
