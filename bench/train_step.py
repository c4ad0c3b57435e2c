"""Trainer step speed: miles' FSDP2 trainer against a bare PyTorch loop of the same loss and optimizer.

Both train the tiny-sd3 transformer (full fine-tune, fp32, CPU) on the same Flow-GRPO pairs of one
rollout (CFG, recomputed SDE log-probs, PPO-clip loss, AdamW, grad clipping), micro-batch by
micro-batch with gradient accumulation, one optimizer step per window. The bare loop is a plain
`nn.Module` with no sharding, no process group and no bookkeeping. Prints medians and the ratio
(goal: <= 1.10).

    python bench/train_step.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
from bare_grpo import bare_micro_step, settings_of
from bench_timing import interleaved_medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()

    from miles.builtin.checkpoints import ensure_checkpoint
    from miles.config.resolve import resolve
    from miles.rollout.manager import RolloutManager
    from miles.training.model import family_of, load_transformer
    from miles.training.optim import clip_grad_norm
    from miles.training.pairs import expand_flow_grpo, micro_batches
    from miles.training.trainer import Trainer

    checkpoint = ensure_checkpoint("tiny-sd3")
    cli = {
        "hf_checkpoint": str(checkpoint),
        "prompt_data": "digits:train",
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "rollout_microgroup_size": 8,
        "global_batch_size": 128,
        "micro_batch_size": 32,
        "lr": 1e-4,
    }
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    samples = RolloutManager(args).generate(0).samples
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = Trainer(args, 0, 1, "127.0.0.1", port, total_steps=100)

    family = family_of(args)
    model = load_transformer(args, family)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
    )
    pairs = expand_flow_grpo(samples)
    settings = settings_of(args)  # the job's own, as the trainer runs them

    def bare() -> None:
        batches = micro_batches(pairs, args)
        for batch in batches:
            bare_micro_step(model, batch, len(pairs), settings)
        clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def ours() -> None:
        trainer.train(0, samples)

    medians = interleaved_medians({"bare": bare, "ours": ours}, opts.repeats)
    bare_s, ours_s = medians["bare"], medians["ours"]
    print(f"tiny-sd3 full FT, {len(pairs)} Flow-GRPO pairs in one optimizer step, micro-batch 32, CFG 4.0, fp32 CPU")
    print(f"bare PyTorch loop (nn.Module + AdamW)  {bare_s * 1000:8.1f} ms")
    print(f"miles Trainer.train (FSDP2, gloo)      {ours_s * 1000:8.1f} ms")
    print(f"ratio ours/bare                        {ours_s / bare_s:8.3f}  (goal <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
