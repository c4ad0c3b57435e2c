"""The components the tiny builds share (CLIP and T5 text encoders, the 8x AutoencoderKL), at toy size,
each initialised from its own seed; tiny-sd3 uses all of them, tiny-flux the T5 and the VAE.

The sizes below are tiny-sd3's; its transformer and scheduler live in `miles.builtin.tiny.sd3`.

Sizes (SD3 layout, three text encoders so sglang-diffusion's native SD3 pipeline can serve it):
  text_encoder / text_encoder_2: CLIPTextModelWithProjection, hidden 32, 2 layers, 4 heads,
      projection 32, 77 positions (CLIP-L / CLIP-G stand-ins; ~40k params each)
  text_encoder_3: T5EncoderModel, d_model 64 (= joint_attention_dim), 2 layers, 4 heads
  transformer: SD3Transformer2DModel, 2 joint blocks, 4 heads x 16 = 64 wide, patch 2, 4 latent
      channels, sample_size 8 (8x8 latents -> 16 image tokens)
  vae: AutoencoderKL with 4 down/up blocks (16, 32, 32, 32) -> 8x spatial compression, 64x64 images
  scheduler: FlowMatchEulerDiscreteScheduler(shift=1.0)
"""

from __future__ import annotations

from typing import Any

CLIP_HIDDEN = 32
CLIP_PROJECTION = 32
JOINT_ATTENTION_DIM = 64  # >= CLIP_HIDDEN * 2, == T5 d_model
POOLED_PROJECTION_DIM = 2 * CLIP_PROJECTION
LATENT_CHANNELS = 4
LATENT_SIZE = 8
VAE_BLOCKS = (16, 32, 32, 32)
IMAGE_SIZE = LATENT_SIZE * 2 ** (len(VAE_BLOCKS) - 1)

# component -> offset added to the build seed, so each init is independent of the others' order
SEED_OFFSETS = {"text_encoder": 1, "text_encoder_2": 2, "text_encoder_3": 3, "transformer": 4, "vae": 5}


def seeded(seed: int, name: str, offsets: dict[str, int] | None = None) -> None:
    """Seed torch for the component `name`: `seed * 1000 + offsets[name]` (default: tiny-sd3's `SEED_OFFSETS`), so
    each init is independent of the order the others are made in."""
    import torch

    torch.manual_seed(seed * 1000 + (SEED_OFFSETS if offsets is None else offsets)[name])


def clip_text_config(tok: dict[str, int], **extra: Any) -> Any:
    """The tiny CLIP text encoders' `CLIPTextConfig` (tiny-sd3's two, tiny-flux's one), with `extra` (a projection)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=tok["clip_vocab_size"],
        hidden_size=CLIP_HIDDEN,
        intermediate_size=2 * CLIP_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tok["clip_bos_id"],
        eos_token_id=tok["clip_eos_id"],
        pad_token_id=tok["clip_pad_id"],
        hidden_act="quick_gelu",
        **extra,
    )


def make_clip_text_encoder(seed: int, name: str, tok: dict[str, int]) -> Any:
    from transformers import CLIPTextModelWithProjection

    config = clip_text_config(tok, projection_dim=CLIP_PROJECTION)
    seeded(seed, name)
    return CLIPTextModelWithProjection(config).eval()


# a Qwen chat layout's template: one turn per message, then the assistant's header; under `enable_thinking=False`
# (FLUX.2-klein's call) the empty think block Qwen3's own template writes
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen3_chat_tokenizer(layout: str) -> Any:
    """The offline byte-level BPE Qwen tokenizer learned from the digit prompts in `layout` (a chat turn with `{}`
    for the prompt), with Qwen3's chat template (tiny-flux2-klein, tiny-z-image)."""
    from miles.models.qwen_image.tokenizer import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer(layout)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen3_text_config(tokenizer: Any, hidden: int, layers: int, **extra: Any) -> Any:
    """A tiny Qwen3 text model's config: `layers` layers `hidden` wide, 2 query heads and 1 key-value head of 16."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def make_t5_encoder(seed: int, tok: dict[str, int]) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=tok["t5_vocab_size"],
        d_model=JOINT_ATTENTION_DIM,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tok["t5_pad_id"],
        eos_token_id=tok["t5_eos_id"],
        decoder_start_token_id=tok["t5_pad_id"],
        is_encoder_decoder=False,
        use_cache=False,
    )
    seeded(seed, "text_encoder_3")
    return T5EncoderModel(config).eval()


def make_vae(seed: int) -> Any:
    from diffusers import AutoencoderKL

    seeded(seed, "vae")
    n = len(VAE_BLOCKS)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
