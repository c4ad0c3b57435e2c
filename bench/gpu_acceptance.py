"""GPU acceptance of the colocated path: `train rl` with LoRA, offload and in-place weight sync on one GPU.

`build` writes a shape-faithful SD3.5-Medium pipeline offline: the transformer with SD3.5-Medium's real
config (24 MM-DiT blocks, 24 heads x 64, dual attention in blocks 0-12, RMS qk-norm, 2.5 B parameters)
and random weights, SD3.5's VAE layout (16 latent channels) with random weights, and tiny text encoders
whose outputs have the real widths (CLIP-L 768, CLIP-G 1280, T5 4096 over 256 tokens), with miles'
offline tokenizers. Nothing comes from a hub. `run` trains it with `miles train rl` for 2 rollouts,
colocated on one GPU (trainer 0.7, engine 0.25), LoRA, offload between phases and in-place (CUDA IPC)
LoRA sync, and prints peak GPU memory (nvidia-smi, every process on the GPU; the trainer's
torch.cuda.max_memory_allocated) next to the memory plan's estimate of the same job, images/s, train step time
and the engine-trainer log-prob difference.

    bash bench/gpu_acceptance.sh                  # build + run, under 10 minutes on one H100/H200-class GPU
    python bench/gpu_acceptance.py build DIR [--layers N]
    python bench/gpu_acceptance.py run DIR [--resolution 512] [--layers N]

`--layers` / `--resolution` shrink the model for a CPU smoke test of the script itself (not a result).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# SD3.5-Medium's transformer config (stabilityai/stable-diffusion-3.5-medium, transformer/config.json).
SD35_MEDIUM_TRANSFORMER: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
# SD3.5's VAE layout (16 latent channels, 8x downsampling, its latent shift and scale).
SD35_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}


def build(out: Path, layers: int) -> dict[str, int]:
    """Write the pipeline to `out` (bf16 weights); returns parameter counts."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from miles.models.tiny.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()

    def clip(hidden: int, heads: int) -> Any:
        config = CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=hidden,
            intermediate_size=hidden,
            num_hidden_layers=1,
            num_attention_heads=heads,
            projection_dim=hidden,
            max_position_embeddings=77,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
        return CLIPTextModelWithProjection(config).eval()

    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=4096,
            d_kv=64,
            d_ff=512,
            num_layers=1,
            num_heads=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()
    config = dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers)
    config["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"] if i < layers)
    with torch.device(device):
        transformer = SD3Transformer2DModel(**config)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.to("cpu", torch.bfloat16),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=AutoencoderKL(**SD35_VAE),
        text_encoder=clip(768, 12),
        tokenizer=clip_tok,
        text_encoder_2=clip(1280, 20),
        tokenizer_2=clip_tok,
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
    )
    pipe.save_pretrained(out)
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in ("transformer", "vae")}


class GpuMemoryPeak:
    """Polls nvidia-smi (all processes on the GPU: trainer, engine, reward) and keeps the peak, in MiB."""

    def __init__(self, interval: float = 0.2) -> None:
        self.peak = 0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.peak = max([self.peak, *(int(v) for v in text.split() if v.isdigit())])
            except (OSError, subprocess.SubprocessError):
                return
            time.sleep(self.interval)

    def __enter__(self) -> GpuMemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_flags(checkpoint: Path, out: Path, resolution: int) -> list[str]:
    return [
        "train", "rl",
        "--hf-checkpoint", str(checkpoint),
        "--diffusion-model-family", "sd3",
        "--prompt-data", "digits:labels",
        "--rm-type", "jpeg_compressibility",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
        "--colocate",
        "--rollout-backend", "diffusers",
        "--use-lora", "--lora-rank", "32", "--lora-alpha", "64", "--lora-ipc-weight-sync",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--rollout-microgroup-size", "8",
        "--global-batch-size", "32", "--micro-batch-size", "8",
        "--diffusion-num-steps", "10",
        "--diffusion-step-strategy-path", "miles.sampling.step_strategies.sde_window",
        "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,10",
        "--diffusion-height", str(resolution), "--diffusion-width", str(resolution),
        "--diffusion-guidance-scale", "4.5",
        "--diffusion-forward-dtype", "bf16",
        "--gradient-checkpointing",
        "--lr", "1e-4",
        "--num-rollout", "2",
        "--output-dir", str(out),
    ]  # fmt: skip


def estimated(checkpoint: Path, out: Path, resolution: int) -> dict[str, float]:
    """The memory plan of the same job (`miles plan --format json`): GPU 0's train phase, without the CUDA margin
    (what `torch.cuda.max_memory_allocated` in the trainer sees), and its peak over the phases with the margin
    (what nvidia-smi sees: every process, the CUDA context)."""
    from miles.memory.estimate import MARGIN_GIB

    flags = run_flags(checkpoint, out, resolution)[2:]
    argv = [sys.executable, "-c", "from miles_cli.main import entry; entry()", "plan", "--job", "rl", *flags]
    rows = json.loads(subprocess.run([*argv, "--format", "json"], check=True, capture_output=True, text=True).stdout)
    memory = next(r["memory"] for r in rows if r["node"] == 0 and r["gpu"] == 0)
    peak = max(phase["gib"] for phase in memory.values())
    return {"train": memory["train"]["gib"], "peak": peak + MARGIN_GIB}


def run(root: Path, resolution: int) -> dict[str, float]:
    """`miles train rl` on the built checkpoint; the figures of the acceptance."""
    checkpoint, out = root / "sd35m-shaped", root / "run"
    argv = [sys.executable, "-c", "from miles_cli.main import entry; entry()", *run_flags(checkpoint, out, resolution)]
    start = time.perf_counter()
    with GpuMemoryPeak() as memory:
        result = subprocess.run(argv, check=False)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"miles train rl failed with exit code {result.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]
    samples = last["rollout/num_samples"]
    estimate = estimated(checkpoint, out, resolution)
    return {
        "wall_s": wall,
        "estimated_train_peak_gib": estimate["train"],
        "train_max_memory_allocated_gib": max(r.get("train/max_memory_allocated_gib", float("nan")) for r in rows),
        "estimated_peak_gib": estimate["peak"],
        "peak_gpu_memory_gib": memory.peak / 1024,
        "images_per_s": samples / last["perf/generate_time"],
        "train_step_s": last["perf/train_time"],
        "log_prob_abs_diff_first_step": max(r["train/log_prob_abs_diff_first_step"] for r in rows),
        "sync_s": last["perf/sync_time"],
        "offload_s": last.get("perf/offload_time", float("nan")),
        "onload_s": last.get("perf/onload_time", float("nan")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "run"))
    parser.add_argument("root", type=Path)
    parser.add_argument("--layers", type=int, default=SD35_MEDIUM_TRANSFORMER["num_layers"])
    parser.add_argument("--resolution", type=int, default=512)
    opts = parser.parse_args()
    if opts.command == "build":
        start = time.perf_counter()
        counts = build(opts.root / "sd35m-shaped", opts.layers)
        print(f"built {opts.root / 'sd35m-shaped'} in {time.perf_counter() - start:.0f} s: {counts}")
        return 0
    figures = run(opts.root, opts.resolution)
    for key, value in figures.items():
        print(f"{key:32s} {value:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
