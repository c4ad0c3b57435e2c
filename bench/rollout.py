"""Rollout speed: our SDE sampler with log-prob recording against plain `StableDiffusion3Pipeline.__call__`.

Both run tiny-sd3 in one process with the same prompt, seeds, steps, batch, resolution and CFG, and
both decode to images. Ours also runs the step strategy's SDE steps, records every latent and the
log-prob of every SDE transition. Prints the medians and the ratio (goal: <= 1.05).

    python bench/rollout.py [--steps 10] [--batch 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_timing import interleaved_medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sde-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args()

    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.config.resolve import resolve
    from miles.rollout.engines.base import GenerateRequest
    from miles.rollout.engines.diffusers_engine import DiffusersEngine

    checkpoint = ensure_checkpoint("tiny-sd3")
    args = resolve("rl", recipe="tiny-digits-grpo", cli={"hf_checkpoint": str(checkpoint)}).args
    engine = DiffusersEngine(args, device="cpu")
    pipe = engine.pipe
    prompt, seeds = "a handwritten digit 7", list(range(100, 100 + opts.batch))
    window = list(range(opts.sde_steps))
    request = GenerateRequest(
        prompt=prompt,
        metadata={"label": 7},
        group_index=0,
        indices=list(range(opts.batch)),
        seeds=seeds,
        sde_steps=[window] * opts.batch,
        num_steps=opts.steps,
        guidance_scale=4.0,
        noise_level=0.7,
        sde_type="sde",
        height=64,
        width=64,
        negative_prompt=" ",
    )

    def ours() -> None:
        engine.generate([request])

    def plain() -> None:
        with torch.no_grad():
            pipe(
                prompt=prompt,
                negative_prompt=" ",
                num_inference_steps=opts.steps,
                guidance_scale=4.0,
                height=64,
                width=64,
                num_images_per_prompt=opts.batch,
                generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
                max_sequence_length=engine.max_sequence_length,
                output_type="pt",
            )

    medians = interleaved_medians({"plain": plain, "ours": ours}, opts.repeats)
    plain_s, ours_s = medians["plain"], medians["ours"]
    print(f"tiny-sd3, {opts.steps} steps, batch {opts.batch}, 64x64, CFG 4.0, {opts.sde_steps} SDE steps recorded")
    print(f"plain StableDiffusion3Pipeline.__call__  {plain_s * 1000:8.1f} ms")
    print(f"miles DiffusersEngine.generate          {ours_s * 1000:8.1f} ms")
    print(f"ratio ours/plain                         {ours_s / plain_s:8.3f}  (goal <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
