"""`--diffusion-cfg-uncond-grad`: one Flow-GRPO optimizer step with the unconditional branch's gradient kept (`full`,
one batched 2B forward and its backward) against detached (`detach`: a B forward without grad, then a B forward and
backward), at `tiny-digits-grpo`'s sizes: 120 samples x 9 SDE steps = 1,080 pairs, micro-batch 120, CFG 4, fp32.

Two `Trainer`s (one gloo rank, FSDP2 at world 1), the same args but the flag, on the same rollout, interleaved; prints
the median wall and CPU seconds (this process, all its threads) of `Trainer.train` and the ratios detach / full. The
checkpoint is `tiny-sd3` (the recipe's `tiny-sd3-digits-sft-short` is the same architecture after a short SFT;
the weights do not change the time).

    nice -n 19 python bench/cfg_uncond_grad.py [--repeats 5]

On a CPU other jobs share, run it with OMP_WAIT_POLICY=PASSIVE (or OMP_NUM_THREADS=1): OpenMP's threads otherwise
spin while they wait for a core, and the CPU seconds count the spinning (measured: 14.7 CPU-s a step under a load of
7 on 2 cores, against 4.9 with passive waits) and hide the difference.
"""

from __future__ import annotations

import argparse
import socket
import sys

from bench_timing import interleaved_wall_and_cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.config.resolve import resolve
    from miles.rollout.manager import RolloutManager
    from miles.training.trainer import Trainer

    cli = {
        "hf_checkpoint": str(ensure_checkpoint("tiny-sd3")),
        "rollout_batch_size": 15,  # 15 prompts x 8 = 120 samples: the recipe's one optimizer window
        "n_samples_per_prompt": 8,
        "rollout_microgroup_size": 8,
        "global_batch_size": 120,
        "micro_batch_size": 120,
        "lr_warmup_iters": 0,
    }
    args = {
        mode: resolve("rl", recipe="tiny-digits-grpo", cli={**cli, "diffusion_cfg_uncond_grad": mode}).args
        for mode in ("full", "detach")
    }
    samples = RolloutManager(args["full"]).generate(0).samples
    kept = [s for s in samples if not s.remove_sample]
    pairs = sum(len(s.trajectory.sde_step_indices) for s in kept)
    trainers = {mode: Trainer(a, 0, 1, "127.0.0.1", free_port(), total_steps=100) for mode, a in args.items()}
    losses: dict[str, list[float]] = {mode: [] for mode in trainers}

    def step(mode: str):
        def run() -> None:
            losses[mode].append(trainers[mode].train(0, samples)["loss"])

        return run

    medians = interleaved_wall_and_cpu({mode: step(mode) for mode in trainers}, opts.repeats)
    (full_wall, full_cpu), (detach_wall, detach_cpu) = medians["full"], medians["detach"]
    print(
        f"tiny-sd3 full FT, one Flow-GRPO optimizer step: {len(kept)} samples, {pairs} pairs, micro-batch 120, "
        f"CFG {args['full'].diffusion_guidance_scale}, fp32 CPU, medians of {opts.repeats} interleaved repeats"
    )
    print(f"first step's loss: full {losses['full'][0]:.9g}, detach {losses['detach'][0]:.9g} (the same weights)")
    print(f"{'':40s}{'wall s':>10s}{'CPU s':>10s}")
    print(f"{'--diffusion-cfg-uncond-grad full':40s}{full_wall:10.3f}{full_cpu:10.3f}")
    print(f"{'--diffusion-cfg-uncond-grad detach':40s}{detach_wall:10.3f}{detach_cpu:10.3f}")
    print(f"{'ratio detach / full':40s}{detach_wall / full_wall:10.3f}{detach_cpu / full_cpu:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
