"""`build_tiny_ltx2(out_dir, seed)`: LTX-2's audio-video architecture at toy size, built fully offline from a seed.

The result is a normal diffusers LTX2Pipeline directory (`LTX2Pipeline.from_pretrained(dir)` loads it), plus:
    digit_classifier/       the VIDEO digit classifier (as tiny-wan2_2's: per frame, the digit cropped around its
                            ink centroid; see miles.models.digit_classifier)
    miles_tiny.json         metadata: max_sequence_length, resolution, num_frames, fps, VAE stats, the VAE's
                            reconstruction scores (per-frame digit accuracy, direction accuracy), params, timings
The directory appears atomically (built in a temp sibling, then renamed).

Components (each initialised from its own seed; torch/diffusers/transformers are imported on use only):
  tokenizer: a Gemma BPE laid out by hand: Gemma's specials, single characters (Gemma's normalizer turns spaces
      into "▁"), and one merge chain per "▁word" of the moving-digit prompts, so "the digit 7 moving left" is
      7 tokens (t, h, e, ▁digit, ▁7, ▁moving, ▁left; Gemma adds no dummy prefix)
  text_encoder: Gemma3ForConditionalGeneration, 2 layers 32 wide (2 heads x 16, 1 kv head) with a 1-layer
      SigLIP tower (unused by text prompts; the image token ids point into the tiny vocab)
  connectors: LTX2TextConnectors, caption_channels 32 (= Gemma's width = heads x head_dim), text_proj_in_factor 3
      (Gemma's layers + 1: the pipeline stacks every hidden state), 8 registers (the text length must be a
      multiple of 8)
  transformer: LTX2VideoTransformer3DModel, 2 layers, video 4 heads x 32 over 16 channels, audio 4 heads x 32 over
      16 (= audio latent channels x latent mel bins), vae_scale_factors (1, 16, 16) (the VAE's, for RoPE)
  vae: AutoencoderKLLTX2Video at toy size: 16x16 pixel patches and no down stage (16x spatial, 1x temporal,
      9 frames -> 9 latent frames of 4x4, 16 channels; 144 video tokens). families.md's trap 2: the
      compression ratios are given explicitly. Fitted to moving digits of the train split (`vae_steps`);
      per-channel latents_mean/latents_std (buffers of this VAE) set from the posterior means
  audio_vae: AutoencoderKLLTX2Audio, 4 latent channels x 16 mel bins (4 latent bins); families.md's trap 1:
      base_channels = latent channels x mel bins / 4 = 16 (its latents_mean is applied to the packed token)
  vocoder: LTX2Vocoder, 16 hidden channels (never run by miles: rewards read the video)
  scheduler: FlowMatchEulerDiscreteScheduler with LTX-2's dynamic shift (0.95..2.05 over 1024..4096 tokens) and
      shift_terminal 0.1
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.builtin.tiny.build import BuildReport
from miles.builtin.tiny.components import seeded
from miles.builtin.tiny.frame import MovingDigitsBuild
from miles.builtin.tiny.video_vae import video_prompts
from miles.models.tiny.metadata import FORMAT_VERSION, current_design

__all__ = ["TINY_LTX2_NAME", "BuildReport", "build_tiny_ltx2"]

TINY_LTX2_NAME = "tiny-ltx2"

# text side
GEMMA_SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
TEXT_DIM = 32  # Gemma's hidden size == the connectors' and the DiT's caption_channels
TEXT_LAYERS = 2
# Gemma tokens (a multiple of the connectors' 8 registers): the prompts' 7 tokens and one register (design 1's 32
# put 25 registers beside them, which the DiT's cross attention averaged over)
TINY_LTX2_MAX_SEQUENCE_LENGTH = 8
CONNECTOR_REGISTERS = 8

# the DiT (design 2: 2 layers 128 wide; design 1's one layer 32 wide over 2304 tokens a clip did not learn the
# digits: SFT accuracy stayed at chance, 0.09 after 200 steps)
NUM_LAYERS = 2
NUM_ATTENTION_HEADS = 4
ATTENTION_HEAD_DIM = 32

# the video VAE: 16x16 pixel patches and no down stage (16x spatial, no temporal compression): a 64x64 frame is a
# 4x4 latent (144 video tokens a 9-frame clip, 16 a frame as tiny-flux's images). Measured on 2 cores: 0.14 s a fit
# step (batch 8); 1,500 steps reach a test MSE of 0.038 and per-frame digit accuracy 0.78 on the reconstructions
# (decoder width 16: 0.68 after 1,000 steps; 8x8 patches with 8 channels: 0.93, but 576 tokens a clip, and the DiT
# learned no digits from them in 300 SFT steps, nor from design 1's 2304)
LATENT_CHANNELS = 16
VAE_CHANNELS = 64  # the decoder's width (the encoder's is LATENT_CHANNELS: it has no down stage to widen it)
VAE_PIXEL_PATCH = 16
SPATIAL_COMPRESSION = 16
TEMPORAL_COMPRESSION = 1
VAE_STEPS = 1500
# the posterior log-variance's initial bias: std ~0.05 instead of ~1 (tiny-wan2_2's VAE_INIT_LOGVAR)
VAE_INIT_LOGVAR = -6.0
VAE_BATCH_SIZE = 8
VAE_LR = 1e-2
VAE_STATS_VIDEOS = 256

# the audio VAE (never decoded by miles; sized by families.md's trap 1)
AUDIO_LATENT_CHANNELS = 4
AUDIO_MEL_BINS = 16
AUDIO_MEL_COMPRESSION = 4
AUDIO_BASE_CHANNELS = AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // AUDIO_MEL_COMPRESSION
AUDIO_TOKEN_DIM = AUDIO_LATENT_CHANNELS * (AUDIO_MEL_BINS // AUDIO_MEL_COMPRESSION)
AUDIO_SAMPLE_RATE = 16000
AUDIO_HOP_LENGTH = 160

# the videos it is built for (miles.data.digits_video)
RESOLUTION = 64
NUM_FRAMES = 9
FPS = 8
LATENT_SIZE = RESOLUTION // SPATIAL_COMPRESSION
LATENT_FRAMES = (NUM_FRAMES - 1) // TEMPORAL_COMPRESSION + 1

# component -> offset added to the build seed (seed * 1000 + offset), so each init is independent of the others'
SEED_OFFSETS = {"text_encoder": 3, "connectors": 4, "transformer": 5, "vae": 6, "audio_vae": 7, "vocoder": 8}

# LTX-2's scheduler config (Lightricks/LTX-2 in diffusers)
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
}


def make_tokenizer() -> Any:
    """The hand-laid Gemma BPE (see the module docstring); deterministic, no trainer."""
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(GEMMA_SPECIALS)}
    for code in range(32, 127):
        vocab.setdefault("\u2581" if code == 32 else chr(code), len(vocab))
    merges: list[tuple[str, str]] = []
    words = sorted({w for p in video_prompts() for w in p.split()})
    for word in words:
        cur = "\u2581"
        for ch in word:
            nxt = cur + ch
            if nxt not in vocab:
                merges.append((cur, ch))
                vocab[nxt] = len(vocab)
            cur = nxt
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=TINY_LTX2_MAX_SEQUENCE_LENGTH)


def make_text_encoder(seed: int, tokenizer: Any) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_DIM,
            "intermediate_size": 2 * TEXT_DIM,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "sliding_window": 64,
            "pad_token_id": ids["<pad>"],
            "eos_token_id": ids["<eos>"],
            "bos_token_id": ids["<bos>"],
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    seeded(seed, "text_encoder", SEED_OFFSETS)
    return Gemma3ForConditionalGeneration(config).eval()


def make_connectors(seed: int) -> Any:
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    seeded(seed, "connectors", SEED_OFFSETS)
    heads, head_dim = 2, TEXT_DIM // 2
    return LTX2TextConnectors(
        caption_channels=TEXT_DIM,
        text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=heads,
        video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=CONNECTOR_REGISTERS,
        audio_connector_num_attention_heads=heads,
        audio_connector_attention_head_dim=head_dim,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=CONNECTOR_REGISTERS,
    )


def make_transformer(seed: int) -> Any:
    from diffusers import LTX2VideoTransformer3DModel

    seeded(seed, "transformer", SEED_OFFSETS)
    return LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        attention_head_dim=ATTENTION_HEAD_DIM,
        cross_attention_dim=NUM_ATTENTION_HEADS * ATTENTION_HEAD_DIM,
        vae_scale_factors=(TEMPORAL_COMPRESSION, SPATIAL_COMPRESSION, SPATIAL_COMPRESSION),
        base_height=RESOLUTION,
        base_width=RESOLUTION,
        audio_in_channels=AUDIO_TOKEN_DIM,
        audio_out_channels=AUDIO_TOKEN_DIM,
        audio_num_attention_heads=NUM_ATTENTION_HEADS,
        audio_attention_head_dim=ATTENTION_HEAD_DIM,
        audio_cross_attention_dim=NUM_ATTENTION_HEADS * ATTENTION_HEAD_DIM,
        audio_scale_factor=AUDIO_MEL_COMPRESSION,
        audio_sampling_rate=AUDIO_SAMPLE_RATE,
        audio_hop_length=AUDIO_HOP_LENGTH,
        num_layers=NUM_LAYERS,
        caption_channels=TEXT_DIM,
    )


def make_vae(seed: int) -> Any:
    """The tiny `AutoencoderKLLTX2Video` (latents_mean/std are buffers, set after the fit)."""
    import torch
    from diffusers import AutoencoderKLLTX2Video

    seeded(seed, "vae", SEED_OFFSETS)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(LATENT_CHANNELS,),  # without a down stage the encoder stays latent-wide
        down_block_types=("LTX2VideoDownBlock3D",),
        decoder_block_out_channels=(VAE_CHANNELS,),
        layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(False,),
        decoder_spatio_temporal_scaling=(False,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        patch_size=VAE_PIXEL_PATCH,
        patch_size_t=1,
        spatial_compression_ratio=SPATIAL_COMPRESSION,  # trap 2: the computed ratio is wrong at toy size
        temporal_compression_ratio=TEMPORAL_COMPRESSION,
    )
    with torch.no_grad():  # the posterior's (shared) log-variance channel starts small (see VAE_INIT_LOGVAR)
        vae.encoder.conv_out.conv.bias[-1] = VAE_INIT_LOGVAR
    return vae


def make_audio_vae(seed: int) -> Any:
    from diffusers import AutoencoderKLLTX2Audio

    seeded(seed, "audio_vae", SEED_OFFSETS)
    return AutoencoderKLLTX2Audio(
        base_channels=AUDIO_BASE_CHANNELS,  # trap 1: = latent channels x mel bins / 4
        output_channels=2,
        ch_mult=(1, 2),
        num_res_blocks=1,
        in_channels=2,
        resolution=32,
        latent_channels=AUDIO_LATENT_CHANNELS,
        mel_bins=AUDIO_MEL_BINS,
        sample_rate=AUDIO_SAMPLE_RATE,
        mel_hop_length=AUDIO_HOP_LENGTH,
    )


def make_vocoder(seed: int) -> Any:
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    seeded(seed, "vocoder", SEED_OFFSETS)
    return LTX2Vocoder(
        in_channels=2 * AUDIO_MEL_BINS,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1]],
        output_sampling_rate=AUDIO_SAMPLE_RATE,
    )


def make_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def grid_configs() -> dict[str, dict[str, Any]]:
    """The configs the torch-free denoising grid (`miles.sampling.grid`) reads, as this build writes them
    ({component: those keys of its config}), so `miles inspect-config` shows the grid before the first build."""
    return {
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER_CONFIG},
        "vae": {"spatial_compression_ratio": SPATIAL_COMPRESSION, "temporal_compression_ratio": TEMPORAL_COMPRESSION},
    }


def set_video_latent_stats(vae: Any, videos: Any, batch_size: int = 32) -> tuple[list[float], list[float]]:
    """Per-channel `latents_mean` / `latents_std` (the LTX-2 video VAE's buffers) from the posterior means of
    `videos`, so the pipeline's normalised latents are zero-mean, unit-variance per channel on the data."""
    import torch

    from miles.builtin.tiny.vae_fit import encode_mean

    latents = encode_mean(vae, videos, batch_size).double().transpose(0, 1).flatten(1)
    mean = [round(float(v), 6) for v in latents.mean(dim=1)]
    std = [round(float(v), 6) for v in latents.std(dim=1)]
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor(mean))
        vae.latents_std.copy_(torch.tensor(std))
    return mean, std


class TinyLtx2Build(MovingDigitsBuild):
    """tiny-ltx2's phases: the hand-laid Gemma BPE, a Gemma 3 encoder and the text connectors, the audio-video
    DiT, the LTX-2 video VAE fitted to the moving digits; the audio VAE and vocoder are made when the pipeline is
    assembled (never fitted: rewards read the video)."""

    name = TINY_LTX2_NAME
    num_frames = NUM_FRAMES
    stats_videos = VAE_STATS_VIDEOS

    def tokenizers(self) -> None:
        self.tokenizer = make_tokenizer()
        self.prompt_tokens = max(len(self.tokenizer(p).input_ids) for p in video_prompts())
        assert self.prompt_tokens <= TINY_LTX2_MAX_SEQUENCE_LENGTH, self.prompt_tokens

    def text_encoders(self) -> None:
        self.text_encoder = make_text_encoder(self.seed, self.tokenizer)
        self.connectors = make_connectors(self.seed)

    def transformer(self) -> None:
        self.dit = make_transformer(self.seed)

    def make_vae(self) -> Any:
        return make_vae(self.seed)

    def fit_options(self) -> dict[str, Any]:
        return {"batch_size": VAE_BATCH_SIZE, "lr": VAE_LR}

    def latent_stats(self) -> None:
        self.latents_mean, self.latents_std = set_video_latent_stats(self.vae, self.train[: self.stats_videos])

    def pipeline(self) -> Any:
        from diffusers import LTX2Pipeline

        audio_vae, vocoder = make_audio_vae(self.seed), make_vocoder(self.seed)
        return LTX2Pipeline(
            scheduler=make_scheduler(),
            vae=self.vae,
            audio_vae=audio_vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            connectors=self.connectors,
            transformer=self.dit,
            vocoder=vocoder,
        )

    def metadata(self, report: BuildReport) -> dict[str, Any]:
        from miles.data.digits import SPLIT_SEED
        from miles.data.digits_video import PROMPT_TEMPLATE

        return {
            "name": TINY_LTX2_NAME,
            "format_version": FORMAT_VERSION,
            "design": current_design(TINY_LTX2_NAME),
            "seed": self.seed,
            "resolution": RESOLUTION,
            "num_frames": NUM_FRAMES,
            "fps": FPS,
            "latent_size": LATENT_SIZE,
            "latent_frames": LATENT_FRAMES,
            "latent_channels": LATENT_CHANNELS,
            "audio_token_dim": AUDIO_TOKEN_DIM,
            "max_sequence_length": TINY_LTX2_MAX_SEQUENCE_LENGTH,
            "prompt_template": PROMPT_TEMPLATE,
            "data": {"name": "digits-video", "split_seed": SPLIT_SEED},
            "tokenizer": {"vocab_size": len(self.tokenizer), "digit_prompt_tokens": self.prompt_tokens},
            "vae": self.vae_metadata(TEMPORAL_COMPRESSION, SPATIAL_COMPRESSION, VAE_BATCH_SIZE, VAE_LR),
            "digit_classifier": {
                "path": "digit_classifier",
                "input": "video",
                "test_accuracy": report.classifier_test_accuracy,
            },
        }


def build_tiny_ltx2(
    out_dir: str | Path, seed: int = 0, progress: bool = True, vae_steps: int = VAE_STEPS
) -> BuildReport:
    """Build tiny-ltx2 into `out_dir` (which must not exist, or be empty); return timings and accuracies."""
    return TinyLtx2Build.build(out_dir, seed, progress, vae_steps)
