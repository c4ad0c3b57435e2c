"""`build_tiny_flux2_klein(out_dir, seed)`: FLUX.2-klein's architecture at toy size, built fully offline from a seed.

The result is a normal diffusers `Flux2KleinPipeline` directory (a base model: `is_distilled` false, so CFG runs),
plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  tokenizer: a byte-level BPE `Qwen2Tokenizer` learned from the digit prompts in klein's chat layout
      (`<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`), with a
      chat template that writes that layout (the empty think block under `enable_thinking=False`, as Qwen3's)
  text_encoder: Qwen3ForCausalLM, 28 layers of width 32 (2 heads x 16, 1 kv head), so the pipeline's default
      hidden states 9, 18 and 27 are inner layers as in the real 36-layer Qwen3; random (never trained)
  transformer: Flux2Transformer2DModel, 2 double + 2 single blocks, 4 heads x 16 = 64 wide, over the 2x2-
      patchified latents (4 channels x 4 = 16 in), joint_attention_dim 96 (= 3 x 32), RoPE axes (4, 4, 4, 4),
      no guidance embedding; random (training learns it)
  vae: AutoencoderKLFlux2 with tiny-sd3's VAE layout (4 latent channels, 8x), fitted to the 64x64 digits with
      tiny-sd3's fit; its batch-norm running mean / variance set from the patchified posterior means of the
      training digits (the pipeline normalises with them)
  scheduler: FlowMatchEulerDiscreteScheduler with FLUX.2's config (dynamic exponential shift; the pipeline
      passes FLUX.2's empirical mu)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny import components as C
from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import DigitsImageBuild
from miles.builtin.tiny.vae_fit import VAE_STEPS

__all__ = ["TINY_FLUX2_KLEIN_NAME", "BuildReport", "build_tiny_flux2_klein"]

TINY_FLUX2_KLEIN_NAME = "tiny-flux2-klein"

TEXT_HIDDEN = 32
TEXT_LAYERS = 28  # > 27: the pipeline's default hidden states 9, 18, 27 are inner layers
JOINT_ATTENTION_DIM = 3 * TEXT_HIDDEN  # three hidden states side by side
ATTENTION_HEAD_DIM = 16
NUM_ATTENTION_HEADS = 4
AXES_DIMS_ROPE = (4, 4, 4, 4)  # (T, H, W, L); must sum to ATTENTION_HEAD_DIM
PATCHIFIED_CHANNELS = C.LATENT_CHANNELS * 4
# klein's user turn and generation prompt with an empty think block (Qwen3's template, enable_thinking=False)
PROMPT_LAYOUT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# chat tokens of a digit prompt: 18 ("a handwritten digit 3" in the layout above), the longest corpus prompt 20,
# the empty negative 13; rounded up
MAX_SEQUENCE_LENGTH = 24

SEED_OFFSETS = {"text_encoder": 1, "transformer": 4}

# FLUX.2's scheduler config (the pipeline passes its empirical mu; shift 3 is the hub config's, unused then)
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def build_tokenizer() -> Any:
    """The offline Qwen tokenizer learned from the digit prompts in klein's chat layout, with its chat template."""
    return C.qwen3_chat_tokenizer(PROMPT_LAYOUT)


def make_text_encoder(seed: int, tokenizer: Any) -> Any:
    from transformers import Qwen3ForCausalLM

    config = C.qwen3_text_config(tokenizer, TEXT_HIDDEN, TEXT_LAYERS, tie_word_embeddings=True)
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return Qwen3ForCausalLM(config).eval()


def make_transformer(seed: int) -> Any:
    from diffusers import Flux2Transformer2DModel

    seeded(seed, "transformer", SEED_OFFSETS)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=PATCHIFIED_CHANNELS,
        out_channels=None,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=ATTENTION_HEAD_DIM,
        num_attention_heads=NUM_ATTENTION_HEADS,
        joint_attention_dim=JOINT_ATTENTION_DIM,
        timestep_guidance_channels=64,
        mlp_ratio=3.0,
        axes_dims_rope=AXES_DIMS_ROPE,
        rope_theta=2000,
        guidance_embeds=False,
    )


def make_vae(seed: int) -> Any:
    """tiny-sd3's VAE layout as an AutoencoderKLFlux2 (its own batch norm over the 16 patchified channels)."""
    from diffusers import AutoencoderKLFlux2

    seeded(seed, "vae")
    n = len(C.VAE_BLOCKS)
    return AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=C.VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=C.LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=C.IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def set_batch_norm_stats(vae: Any, pixels: Any, batch_size: int = 256) -> tuple[list[float], list[float]]:
    """Set the VAE's batch-norm running mean and variance to those of the patchified posterior means of `pixels`
    (what the pipeline normalises the latents with); return them."""
    import torch

    from miles.models.flux2.config import patchify

    with torch.no_grad():
        starts = range(0, len(pixels), batch_size)
        chunks = [patchify(vae.encode(pixels[i : i + batch_size]).latent_dist.mode()) for i in starts]
    x = torch.cat(chunks).transpose(0, 1).reshape(PATCHIFIED_CHANNELS, -1)
    mean, var = x.mean(dim=1), x.var(dim=1)
    vae.bn.running_mean.copy_(mean)
    vae.bn.running_var.copy_(var)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in var]


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"block_out_channels": list(C.VAE_BLOCKS)},
        "transformer": {"in_channels": PATCHIFIED_CHANNELS, "joint_attention_dim": JOINT_ATTENTION_DIM},
    }


class TinyFlux2KleinBuild(DigitsImageBuild):
    """tiny-flux2-klein's phases: the Qwen tokenizer and text encoder, the FLUX.2 transformer, the digits VAE."""

    name = TINY_FLUX2_KLEIN_NAME

    def tokenizers(self) -> None:
        self.tokenizer = build_tokenizer()

    def text_encoders(self) -> None:
        self.te = make_text_encoder(self.seed, self.tokenizer)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def make_vae(self) -> Any:
        return make_vae(self.seed)

    def latent_stats(self) -> None:
        self.bn_mean, self.bn_var = set_batch_norm_stats(self.vae, self.train)

    def pipeline(self) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

        return Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
            vae=self.vae,
            text_encoder=self.te,
            tokenizer=self.tokenizer,
            transformer=self.dit,
            is_distilled=False,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.builtin.tiny.vae_fit import VAE_BATCH_SIZE, VAE_LR
        from miles.data.digits import PROMPT_TEMPLATE, SPLIT_SEED
        from miles.models.tiny.metadata import FORMAT_VERSION

        return {
            "name": self.name,
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "resolution": C.IMAGE_SIZE,
            "latent_size": C.LATENT_SIZE // 2,
            "latent_channels": PATCHIFIED_CHANNELS,
            "max_sequence_length": MAX_SEQUENCE_LENGTH,
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits", "split_seed": SPLIT_SEED},
            "vae": {
                "batch_norm_mean": self.bn_mean,
                "batch_norm_var": self.bn_var,
                **self.vae_fit_fields(VAE_BATCH_SIZE, VAE_LR),
            },
            "digit_classifier": {"path": "digit_classifier", "test_accuracy": report.classifier_test_accuracy},
        }


def build_tiny_flux2_klein(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-flux2-klein into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyFlux2KleinBuild.build(out_dir, seed, progress, vae_steps)
