"""Each phase of the tiny Flow-GRPO job through miles against the bare library doing the same work, in one run.

1. The job, as a user runs it: `miles train rl --recipe tiny-digits-grpo --num-rollout N` (a Ray cluster on this
   machine, one engine actor, one trainer rank), saving its rollouts (`--save-debug-rollout-data`). Its phase
   timers, medians of rollouts 1..N-1 (rollout 0 warms up): generate, train, sync, and what the driver spends
   outside them (`perf/step_time` minus the phases), plus start-up (the process start to the first rollout).
2. The bare library on the same work, in this process:
   generate  diffusers' own `StableDiffusion3Pipeline.__call__` on the same checkpoint, prompts, batch
             (`--rollout-microgroup-size` images a call), steps, guidance and size (an ODE: no log-probs kept);
   train     a plain `nn.Module` transformer (no FSDP2, no process group), AdamW and clipping, on the job's last
             saved rollout: the same windows, micro-batches, CFG forward, SDE log-prob and clipped loss.
Prints one row per phase with the ratio miles / bare (goal: each <= 1.10) and the driver's time outside the
phases (goal: < 0.3 s an iteration). The table goes in docs/performance.md.

    python bench/phases.py [--rollouts 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def run_job(out: Path, rollouts: int) -> tuple[list[dict[str, float]], float]:
    """The job's metrics rows (with perf/step_time) and its start-up seconds (process start to the first rollout)."""
    from miles.io.metrics import read_metrics

    argv = [
        sys.executable,
        "-c",
        "from miles_cli.main import entry; entry()",
        "train",
        "rl",
        "--recipe",
        "tiny-digits-grpo",
    ]
    argv += ["--num-rollout", str(rollouts), "--output-dir", str(out)]
    argv += ["--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt")]
    start = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    first_seen = None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        if first_seen is None and metrics.exists() and metrics.stat().st_size > 0:
            first_seen = time.time()
        time.sleep(0.2)
    if proc.returncode:
        raise SystemExit(f"the job failed (exit {proc.returncode}); run it by hand to see why: {' '.join(argv)}")
    rows = [r for r in read_metrics(metrics) if "perf/step_time" in r]
    startup = (first_seen or time.time()) - start - rows[0]["perf/step_time"]
    return rows, startup


def bare_generate(args: object, prompts: list[str]) -> float:
    """diffusers' pipeline on the job's prompts, one call per microgroup; seconds."""
    from diffusers import StableDiffusion3Pipeline

    from miles.core.inputs import input_path
    from miles.models.loading import quiet_loading
    from miles.models.tiny.metadata import max_sequence_length

    checkpoint = input_path(args, args.hf_checkpoint)
    with quiet_loading():
        pipe = StableDiffusion3Pipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    size = int(args.rollout_microgroup_size)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        pipe(
            prompt,
            negative_prompt=args.diffusion_negative_prompt,
            num_images_per_prompt=size,
            num_inference_steps=int(args.diffusion_num_steps),
            guidance_scale=float(args.diffusion_guidance_scale),
            height=int(args.diffusion_height),
            width=int(args.diffusion_width),
            output_type="pt",
            generator=torch.Generator().manual_seed(i),
            max_sequence_length=max_sequence_length(checkpoint, default=256),
        )
    return time.perf_counter() - start


def bare_train(args: object, samples: list) -> float:
    """The job's optimizer steps on `samples` with a plain module; seconds."""
    from bare_grpo import bare_micro_step, settings_of

    from miles.training.model import family_of, load_transformer
    from miles.training.pairs import expand_flow_grpo, micro_batches, windows

    model = load_transformer(args, family_of(args))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(args.adam_beta1, args.adam_beta2))
    settings = settings_of(args)
    start = time.perf_counter()
    for window in windows(samples, args):
        pairs = expand_flow_grpo(window)
        for batch in micro_batches(pairs, args):
            bare_micro_step(model, batch, len(pairs), settings)
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(args.clip_grad))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=3)
    opts = parser.parse_args()
    if opts.rollouts < 2:
        parser.error("--rollouts must be at least 2 (rollout 0 warms up)")

    from miles.config.resolve import resolve
    from miles.io.rollout_file import load_rollout

    args = resolve("rl", recipe="tiny-digits-grpo").args
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        rows, startup = run_job(out, opts.rollouts)
        _, samples, _ = load_rollout(out / "rollouts" / f"rollout_{opts.rollouts - 1}.pt")
    steady = rows[1:]

    def med(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in steady)

    size = int(args.rollout_microgroup_size)
    prompts = [samples[i].prompt for i in range(0, len(samples), size)]
    gen_bare = bare_generate(args, prompts)
    train_bare = bare_train(args, samples)
    outside = statistics.median(
        r["perf/step_time"] - r["perf/rollout_time"] - r["perf/train_time"] - r.get("perf/sync_time", 0.0)
        for r in steady
    )
    print(f"tiny-digits-grpo, {len(samples)} samples a rollout; miles: medians of rollouts 1..{opts.rollouts - 1}")
    print(f"{'phase':<26}{'miles s':>10}{'bare s':>10}{'ratio':>8}")
    print(
        f"{'generate (engine actor)':<26}{med('perf/generate_time'):>10.2f}{gen_bare:>10.2f}"
        f"{med('perf/generate_time') / gen_bare:>8.2f}"
    )
    print(
        f"{'train (FSDP2 rank)':<26}{med('perf/train_time'):>10.2f}{train_bare:>10.2f}"
        f"{med('perf/train_time') / train_bare:>8.2f}"
    )
    print(f"{'reward (after generation)':<26}{med('perf/reward_time'):>10.2f}")
    print(f"{'weight sync':<26}{med('perf/sync_time'):>10.2f}")
    print(f"{'driver outside phases':<26}{outside:>10.2f}{'':>10}{'':>8}  (goal < 0.3 s)")
    print(f"{'iteration':<26}{med('perf/step_time'):>10.2f}")
    print(f"{'start-up':<26}{startup:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
