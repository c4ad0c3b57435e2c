"""`build_tiny_qwen_image(out_dir, seed)`: Qwen-Image's architecture at toy size, built fully offline from a seed.

The result is a normal diffusers QwenImagePipeline directory, plus:
    digit_classifier/       the digit reward's classifier (see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, VAE stats, accuracies, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  tokenizer: a byte-level BPE `Qwen2Tokenizer` learned from the digit prompts in the pipeline's template
      (`miles.models.qwen_image.tokenizer`): the template's system prefix is exactly the 34 tokens the
      pipeline drops
  text_encoder: Qwen2_5_VLForConditionalGeneration, 2 layers, hidden 64 (= joint_attention_dim), 4 heads x 16
      (2 kv heads), mRoPE sections (2, 3, 3), a 1-block vision tower; image/video/vision ids in the tiny vocab
  transformer: QwenImageTransformer2DModel, 2 layers, 4 heads x 16 = 64 wide, over 2x2-packed latents
      (4 channels x 4 = 16 in, patch_size 2 -> 16 out), RoPE axes (4, 6, 6); random (training learns it)
  vae: AutoencoderKLQwenImage (a causal 3-D VAE used on 1-frame videos), base_dim 8, z_dim 4, 8x spatial,
      fitted to the 64x64 digits with tiny-sd3's VAE fit; per-channel latents_mean/latents_std set from the
      posterior means of the training digits
  scheduler: FlowMatchEulerDiscreteScheduler with Qwen-Image's config (dynamic exponential shift, terminal 0.02)
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import DigitFramesBuild
from miles.builtin.tiny.vae_fit import VAE_BATCH_SIZE, VAE_LR
from miles.builtin.tiny.video_vae import digits_to_video_input
from miles.models.tiny.metadata import FORMAT_VERSION

__all__ = ["TINY_QWEN_IMAGE_NAME", "BuildReport", "build_tiny_qwen_image", "digits_to_video_input"]

TINY_QWEN_IMAGE_NAME = "tiny-qwen-image"
SGLANG_MODEL_ID = "Qwen-Image"

TEXT_HIDDEN = 64  # == joint_attention_dim
ATTENTION_HEAD_DIM = 16
NUM_ATTENTION_HEADS = 4
MROPE_SECTION = (2, 3, 3)  # (t, h, w) rotary pairs; must sum to head_dim / 2
AXES_DIMS_ROPE = (4, 6, 6)  # (frame, row, col); must sum to ATTENTION_HEAD_DIM
LATENT_CHANNELS = 4  # the VAE's z_dim
PACKED_CHANNELS = LATENT_CHANNELS * 4  # QwenImagePipeline packs 2x2 latent patches into channels
VAE_BASE_DIM = 8
VAE_DIM_MULT = (1, 2, 4, 4)
VAE_TEMPORAL_DOWNSAMPLE = (False, True, True)  # 3 downsamples -> 8x spatial compression
LATENT_SIZE = 8
IMAGE_SIZE = LATENT_SIZE * 2 ** len(VAE_TEMPORAL_DOWNSAMPLE)
VAE_STEPS = 150  # seed 0: classifier accuracy on test reconstructions 0.96 after 50 steps, 0.99 after 100
# prompt tokens after the template drop: a digit prompt gives 10 (a, handwritten, digit, " ", 3 + the
# 5-token template suffix `<|im_end|>\n<|im_start|>assistant\n`), the longest corpus prompt 12; rounded up
TINY_QWEN_MAX_SEQUENCE_LENGTH = 16

# component -> offset added to the build seed (seed * 1000 + offset), so each init is independent
# of the others' order
SEED_OFFSETS = {"text_encoder": 1, "transformer": 4, "vae": 5}

# Qwen/Qwen-Image's scheduler config (resolution-dependent exponential shift, last sigma stretched to 0.02)
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}


def make_text_encoder(seed: int, ids: dict[str, int]) -> Any:
    """The tiny `Qwen2_5_VLForConditionalGeneration` (the pipeline uses its last hidden states)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": ids["vocab_size"],
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 2 * TEXT_HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": NUM_ATTENTION_HEADS,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "max_window_layers": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(MROPE_SECTION)},
            "bos_token_id": ids["endoftext_id"],
            "eos_token_id": ids["im_end_id"],
            "pad_token_id": ids["endoftext_id"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_id"],
        vision_end_token_id=ids["vision_end_id"],
        tie_word_embeddings=False,
    )
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def make_transformer(seed: int) -> Any:
    """The tiny `QwenImageTransformer2DModel` (random)."""
    from diffusers import QwenImageTransformer2DModel

    seeded(seed, "transformer", SEED_OFFSETS)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=PACKED_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=ATTENTION_HEAD_DIM,
        num_attention_heads=NUM_ATTENTION_HEADS,
        joint_attention_dim=TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=AXES_DIMS_ROPE,
    )


def make_vae(seed: int) -> Any:
    """The tiny `AutoencoderKLQwenImage` (latents_mean/std are placeholders until `vae_fit.set_latents_mean_std`)."""
    from diffusers import AutoencoderKLQwenImage

    seeded(seed, "vae", SEED_OFFSETS)
    return AutoencoderKLQwenImage(
        base_dim=VAE_BASE_DIM,
        z_dim=LATENT_CHANNELS,
        dim_mult=list(VAE_DIM_MULT),
        num_res_blocks=1,
        temperal_downsample=list(VAE_TEMPORAL_DOWNSAMPLE),
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
    )


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them
    ({component: those keys of its config}), so `miles inspect-config` shows the grid before the first build."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"temperal_downsample": list(VAE_TEMPORAL_DOWNSAMPLE), "z_dim": LATENT_CHANNELS},
        "transformer": {"in_channels": PACKED_CHANNELS},
    }


def _single_frame_conv_forward(conv: Any, x: Any, cache_x: Any = None) -> Any:
    """A causal Conv3d on one frame with no cache, as the 2-D conv it equals.

    The causal padding puts `kernel_t - 1` zero frames before the frame, so only the kernel's last
    temporal tap sees it (and only that tap gets gradient): the same numbers, for less work.
    """
    import torch.nn.functional as F

    kernel_t = conv.kernel_size[0]
    if cache_x is None and x.shape[2] == 1 and conv.stride[0] == 1 and conv._padding[4] == kernel_t - 1:
        weight = conv.weight[:, :, -1].contiguous()
        padding = (conv._padding[2], conv._padding[0])
        return F.conv2d(x[:, :, 0], weight, conv.bias, stride=conv.stride[1:], padding=padding).unsqueeze(2)
    return type(conv).forward(conv, x, cache_x)


@contextmanager
def single_frame_convs(vae: Any) -> Iterator[Any]:
    """Within the block, `vae`'s causal 3-D convs run 1-frame inputs as 2-D convs.

    The same function (to float rounding, ~1e-5 on decoded pixels) at about half the cost: the build's
    fit, latent statistics and reconstructions run under it; the saved VAE is untouched.
    """
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    convs = [m for m in vae.modules() if isinstance(m, QwenImageCausalConv3d)]
    for conv in convs:
        conv.forward = types.MethodType(_single_frame_conv_forward, conv)
    try:
        yield vae
    finally:
        for conv in convs:
            del conv.forward


def prompt_token_lengths(tokenizer: Any, prompts: list[str], template: str, drop: int) -> list[int]:
    """How many text tokens each prompt gives after the pipeline drops the template's first `drop` tokens."""
    return [len(tokenizer(template.format(p)).input_ids) - drop for p in prompts]


class TinyQwenImageBuild(DigitFramesBuild):
    """tiny-qwen-image's phases: the Qwen BPE learned from the prompt template, a Qwen2.5-VL text encoder, the
    Qwen-Image transformer, its causal 3-D VAE fitted to one-frame digits under 2-D convs."""

    name = TINY_QWEN_IMAGE_NAME

    def tokenizers(self) -> None:
        from miles.data.digits import NUM_LABELS, prompt_for
        from miles.models.qwen_image import tokenizer as qtok
        from miles.models.tiny.tokenizers import prompt_corpus

        template, drop = qtok.qwen_image_prompt_template()
        self.tokenizer = tokenizer = qtok.build_qwen_tokenizer(template)
        prefix_len = len(tokenizer(qtok.template_prefix(template)).input_ids)
        assert prefix_len == drop, f"template prefix is {prefix_len} tokens, the pipeline drops {drop}"
        digit_lengths = prompt_token_lengths(tokenizer, [prompt_for(k) for k in range(NUM_LABELS)], template, drop)
        corpus_lengths = prompt_token_lengths(tokenizer, prompt_corpus(), template, drop)
        assert max(corpus_lengths) <= TINY_QWEN_MAX_SEQUENCE_LENGTH, corpus_lengths
        self.ids = qtok.token_ids(tokenizer)
        self.tokens = {
            "vocab_size": self.ids["vocab_size"],
            "template_drop": drop,
            "digit_prompt_tokens": max(digit_lengths),
            "corpus_max_prompt_tokens": max(corpus_lengths),
        }

    def text_encoders(self) -> None:
        self.text_encoder = make_text_encoder(self.seed, self.ids)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def make_vae(self) -> Any:
        return make_vae(self.seed)

    def vae_context(self) -> AbstractContextManager[Any]:
        return single_frame_convs(self.vae)

    def pipeline(self) -> Any:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline(
            transformer=self.dit,
            scheduler=make_scheduler(),
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.data.digits import PROMPT_TEMPLATE, SPLIT_SEED

        return {
            "name": TINY_QWEN_IMAGE_NAME,
            "format_version": FORMAT_VERSION,
            "seed": self.seed,
            "resolution": IMAGE_SIZE,
            "latent_size": LATENT_SIZE,
            "latent_channels": LATENT_CHANNELS,
            "max_sequence_length": TINY_QWEN_MAX_SEQUENCE_LENGTH,
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits", "split_seed": SPLIT_SEED},
            "sglang_model_id": SGLANG_MODEL_ID,
            "tokenizer": self.tokens,
            "vae": {
                "latents_mean": self.latents_mean,
                "latents_std": self.latents_std,
                **self.vae_fit_fields(VAE_BATCH_SIZE, VAE_LR),
            },
            "digit_classifier": {"path": "digit_classifier", "test_accuracy": report.classifier_test_accuracy},
        }


def build_tiny_qwen_image(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-qwen-image into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyQwenImageBuild.build(out_dir, seed, progress, vae_steps)
