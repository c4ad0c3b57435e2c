"""`build_tiny_wan2_2(out_dir, seed)`: Wan2.2-T2V-A14B's architecture at toy size, built fully offline from a seed.

The result is a normal diffusers WanPipeline directory (`WanPipeline.from_pretrained(dir)` loads it, with both
experts and `boundary_ratio`), plus:
    digit_classifier/       the VIDEO digit classifier (`fit_digit_classifier(video=True)`: per frame, the digit
                            cropped around its ink centroid; see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, num_frames, fps, VAE stats, the VAE's
                            reconstruction scores (per-frame digit accuracy, direction accuracy), params, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  tokenizer: tiny-sd3's offline T5 Unigram, its vocab extended by the moving-digit prompts' words
      ("moving", "right", ...), so "the digit 7 moving left" is 6 tokens with </s>
  text_encoder: UMT5EncoderModel, d_model 64 (= the experts' text_dim), 2 layers, 4 heads x 16
  transformer / transformer_2: two WanTransformer3DModel experts of the same shape, each from its own seed
      (transformer: high noise, t >= boundary_ratio * 1000; transformer_2: low noise); patch (1, 16, 16): ONE
      token per latent frame, 512 values (16 x 16 cells x 2 channels), width 512 (8 heads x 64); random
      (training learns them). Why a frame-wide patch: Wan's DiT has no absolute position signal (RoPE in
      self-attention only, text by cross-attention, an unpadded patch convolution), so with several tokens a
      frame the digit's place must self-organise from the noise, which a tiny expert did not learn in minutes
      (accuracy at chance after 500 steps with 64 tokens a frame); inside a patch every cell has its own output
      row, so a frame-wide patch places the digit absolutely. The width must hold the patch (a 128-value patch
      through a 64-wide expert could not carry the noise back out: generic digits)
  vae: AutoencoderKLWan at toy size, 4x spatial and 1x temporal (9 frames -> 9 latent frames of 16x16, 2
      channels): 4x4 pixel patches (Wan2.2's `patch_size` option) and no down stage; fitted to moving digits of
      the train split; per-channel latents_mean/latents_std set from the posterior means
  scheduler: UniPCMultistepScheduler as Wan2.2-T2V-A14B-Diffusers ships it (flow prediction, flow sigmas,
      flow_shift 12); miles' rollouts step Euler on the same shifted grid (`Wan22TrainPipelineConfig.schedule`)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import MovingDigitsBuild
from miles.builtin.tiny.video_vae import decode_unclamped, make_wan_vae, video_prompts
from miles.models.tiny.metadata import FORMAT_VERSION, current_design

__all__ = ["TINY_WAN2_2_NAME", "BuildReport", "build_tiny_wan2_2"]

TINY_WAN2_2_NAME = "tiny-wan2_2"
SGLANG_MODEL_ID = "Wan2.2-T2V-A14B-Diffusers"

# text side
TEXT_DIM = 64  # UMT5 d_model == the experts' text_dim
TINY_WAN_MAX_SEQUENCE_LENGTH = 16  # UMT5 tokens; a moving-digit prompt needs 6 (with </s>)

# experts (two of this shape)
NUM_LAYERS = 2
NUM_ATTENTION_HEADS = 8
ATTENTION_HEAD_DIM = 64  # RoPE splits it (frame, row, col) = (24, 20, 20)
FFN_DIM = 2 * NUM_ATTENTION_HEADS * ATTENTION_HEAD_DIM
FREQ_DIM = 256  # the timestep's sinusoidal embedding (Wan's)
# one token per latent frame (16 x 16 cells): see the module docstring. Measured (SFT, 40 label prompts, 20
# steps): step 100 accuracy 0.34 / direction 0.95, step 300 0.95 / 1.0, at 0.5 s a step; with 64 tokens a
# frame (patch 1x2x2, 4 heads x 16) both stayed at chance after 500 steps (0.10 / 0.15)
PATCH_SIZE = (1, 16, 16)

# the video VAE
# 4x4 pixel patches (48 channels) and no down stage: 4x spatial, 1x temporal. A moving digit's pixel (a 4x4
# block, moving 4 px a frame) is then one latent cell in every frame, which the fit learns in minutes; with
# Wan2.2's own 8x spatial / 4x temporal the toy VAE read back 0.29 of the frames' digits after 240 steps
# (a latent cell then holds 2x2 digit pixels over 4 frames of motion)
LATENT_CHANNELS = 2  # z_dim == the experts' in/out channels (a digit's pixel is one gray value)
VAE_BASE_DIM = 16
VAE_PIXEL_PATCH = 4
VAE_DIM_MULT = (1,)
VAE_TEMPORAL_DOWNSAMPLE: tuple[bool, ...] = ()  # no down stage, so no temporal compression
TEMPORAL_COMPRESSION = 2 ** sum(VAE_TEMPORAL_DOWNSAMPLE)
SPATIAL_COMPRESSION = VAE_PIXEL_PATCH * 2 ** (len(VAE_DIM_MULT) - 1)
VAE_STEPS = 300
VAE_BATCH_SIZE = 8
VAE_LR = 1e-2
VAE_STATS_VIDEOS = 256  # train videos whose posterior means set latents_mean/latents_std
# the posterior log-variance's initial bias: std ~0.05 instead of ~1, so the fit's sampled latents carry the
# encoder's signal from the first step (with std 1 the noise swamps the ~0.2-scale means at init)
VAE_INIT_LOGVAR = -6.0

# the videos it is built for (miles.data.digits_video)
RESOLUTION = 64
NUM_FRAMES = 9
FPS = 8
LATENT_SIZE = RESOLUTION // SPATIAL_COMPRESSION
LATENT_FRAMES = (NUM_FRAMES - 1) // TEMPORAL_COMPRESSION + 1

BOUNDARY_RATIO = 0.875

# component -> offset added to the build seed (seed * 1000 + offset), so each init is independent
# of the others' order; the two experts get different seeds
SEED_OFFSETS = {"text_encoder": 3, "transformer": 4, "vae": 5, "transformer_2": 6}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers' scheduler config
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 12.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "disable_corrector": [],
    "steps_offset": 0,
}


def make_tokenizer() -> Any:
    """tiny-sd3's T5 tokenizer with the moving-digit prompts' words in its vocab."""
    from miles.models.tiny.tokenizers import build_t5_tokenizer

    return build_t5_tokenizer(extra_corpus=video_prompts())


def make_text_encoder(seed: int, tokenizer: Any) -> Any:
    """The tiny `UMT5EncoderModel` (WanPipeline uses its last hidden states, zero-padded past the prompt)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=2 * TEXT_DIM,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
    )
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return UMT5EncoderModel(config).eval()


def make_transformer(
    seed: int,
    name: str = "transformer",
    in_channels: int = LATENT_CHANNELS,
    patch_size: tuple[int, int, int] = PATCH_SIZE,
    num_attention_heads: int = NUM_ATTENTION_HEADS,
    attention_head_dim: int = ATTENTION_HEAD_DIM,
    ffn_dim: int = FFN_DIM,
) -> Any:
    """One tiny `WanTransformer3DModel` expert (random); `name` ("transformer" or "transformer_2") picks its seed;
    `in_channels` more than the latents' where a condition is concatenated on the channels (tiny-wan2_2-i2v); the
    patch and the width (heads, head dim, FFN) other than tiny-wan2_2's for another layout (tiny-wan2_2-ti2v's)."""
    from diffusers import WanTransformer3DModel

    seeded(seed, name, SEED_OFFSETS)
    return WanTransformer3DModel(
        patch_size=patch_size,
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=in_channels,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=FREQ_DIM,
        ffn_dim=ffn_dim,
        num_layers=NUM_LAYERS,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def make_vae(seed: int) -> Any:
    """The tiny `AutoencoderKLWan` (latents_mean/std are placeholders until `set_latents_mean_std`)."""
    return make_wan_vae(
        seed,
        SEED_OFFSETS,
        base_dim=VAE_BASE_DIM,
        z_dim=LATENT_CHANNELS,
        dim_mult=list(VAE_DIM_MULT),
        temporal_downsample=list(VAE_TEMPORAL_DOWNSAMPLE),
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
    expert = {"patch_size": list(PATCH_SIZE), "in_channels": LATENT_CHANNELS}
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


class TinyWan22Build(MovingDigitsBuild):
    """tiny-wan2_2's phases: tiny-sd3's T5 tokenizer with the moving-digit words, a UMT5 encoder, two experts, a
    Wan VAE with 4x4 pixel patches fitted to the moving digits."""

    name = TINY_WAN2_2_NAME
    num_frames = NUM_FRAMES
    stats_videos = VAE_STATS_VIDEOS

    def tokenizers(self) -> None:
        self.tokenizer = make_tokenizer()
        self.prompt_tokens = max(len(self.tokenizer(p).input_ids) for p in video_prompts())
        assert self.prompt_tokens <= TINY_WAN_MAX_SEQUENCE_LENGTH, self.prompt_tokens

    def text_encoders(self) -> None:
        self.text_encoder = make_text_encoder(self.seed, self.tokenizer)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed, "transformer")
        self.dit_2 = make_transformer(self.seed, "transformer_2")

    def make_vae(self) -> Any:
        return make_vae(self.seed)

    def fit_options(self) -> dict[str, Any]:
        return {"batch_size": VAE_BATCH_SIZE, "lr": VAE_LR, "decode": decode_unclamped}

    def latent_stats(self) -> None:
        from miles.builtin.tiny import vae_fit

        self.latents_mean, self.latents_std = vae_fit.set_latents_mean_std(self.vae, self.train[: self.stats_videos])

    def pipeline(self) -> Any:
        from diffusers import WanPipeline

        return WanPipeline(
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            scheduler=make_scheduler(),
            transformer=self.dit,
            transformer_2=self.dit_2,
            boundary_ratio=BOUNDARY_RATIO,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.data.digits import SPLIT_SEED
        from miles.data.digits_video import PROMPT_TEMPLATE

        return {
            "name": TINY_WAN2_2_NAME,
            "format_version": FORMAT_VERSION,
            "design": current_design(TINY_WAN2_2_NAME),
            "seed": self.seed,
            "resolution": RESOLUTION,
            "num_frames": NUM_FRAMES,
            "fps": FPS,
            "latent_size": LATENT_SIZE,
            "latent_frames": LATENT_FRAMES,
            "latent_channels": LATENT_CHANNELS,
            "max_sequence_length": TINY_WAN_MAX_SEQUENCE_LENGTH,
            "boundary_ratio": BOUNDARY_RATIO,
            "flow_shift": SCHEDULER_CONFIG["flow_shift"],
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits-video", "split_seed": SPLIT_SEED},
            "sglang_model_id": SGLANG_MODEL_ID,
            "tokenizer": {"vocab_size": len(self.tokenizer), "digit_prompt_tokens": self.prompt_tokens},
            "vae": self.vae_metadata(TEMPORAL_COMPRESSION, SPATIAL_COMPRESSION, VAE_BATCH_SIZE, VAE_LR),
            "digit_classifier": {
                "path": "digit_classifier",
                "input": "video",
                "test_accuracy": report.classifier_test_accuracy,
            },
        }


def build_tiny_wan2_2(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-wan2_2 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyWan22Build.build(out_dir, seed, progress, vae_steps)
