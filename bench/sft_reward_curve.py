"""The digit reward along an SFT run: where to start RL from, for any tiny family's SFT recipe.

    python bench/sft_reward_curve.py --recipe tiny-flux-digits-sft --steps 900 --every 75 --from 300

Trains the recipe's SFT in this process (one gloo rank, the same Trainer as `miles train sft`) and, at every
`--every` steps from `--from`, pushes the weights into an in-process engine and measures the mean digit reward
of 10-step SDE rollouts (noise 0.7, the recipe's guidance) over the ten digit prompts, `--samples` per
prompt: the curve the tiny GRPO recipes' start points are chosen from (the reward has room to rise and
responds to RL where the curve turns steep). Prints one line per point and a JSON list at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-flux-digits-sft")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--every", type=int, default=75)
    parser.add_argument("--from", dest="start", type=int, default=300)
    parser.add_argument("--samples", type=int, default=8, help="samples per digit prompt")
    ns = parser.parse_args()

    import numpy as np
    import torch

    from miles.config.resolve import resolve
    from miles.rewards.scorers.digit import digit_reward, load_digit_classifier
    from miles.rollout.engines.base import GenerateRequest
    from miles.rollout.engines.diffusers_engine import DiffusersEngine
    from miles.training.sft_data import encode_sft_dataset
    from miles.training.trainer import Trainer

    args = resolve("sft", recipe=ns.recipe, cli={"num_rollout": ns.steps}).args
    data = encode_sft_dataset(args)
    trainer = Trainer(args, 0, 1, "127.0.0.1", _free_port(), total_steps=ns.steps)
    engine = DiffusersEngine(args, device="cpu")
    classifier = load_digit_classifier(engine.checkpoint)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    points = []
    start = time.perf_counter()
    for step in range(1, ns.steps + 1):
        rows = rng.choice(len(data), int(args.global_batch_size), replace=False).tolist()
        x0, samples = data.batch(rows, generator)
        trainer.train_sft(x0, samples)
        if step < ns.start or (step - ns.start) % ns.every:
            continue
        engine.update_weights(trainer.engine_weights())
        requests = [
            GenerateRequest(
                prompt=f"a handwritten digit {d}",
                metadata={"label": d},
                group_index=d,
                indices=list(range(ns.samples)),
                seeds=[1000 * d + i for i in range(ns.samples)],
                sde_steps=[list(range(9))] * ns.samples,
                num_steps=10,
                guidance_scale=float(args.diffusion_guidance_scale),
                noise_level=0.7,
                sde_type="sde",
                height=int(args.diffusion_height),
                width=int(args.diffusion_width),
                negative_prompt=args.diffusion_negative_prompt,
                true_cfg_scale=args.diffusion_true_cfg_scale,
            )
            for d in range(10)
        ]
        out = engine.generate(requests)
        images = torch.stack([s.image for s in out])
        reward = float(np.mean(digit_reward(images, [s.metadata["label"] for s in out], classifier)))
        points.append({"step": step, "reward": round(reward, 4), "seconds": round(time.perf_counter() - start, 1)})
        print(f"step {step}: digit reward {reward:.3f} ({points[-1]['seconds']} s)", flush=True)
    print(json.dumps({"recipe": ns.recipe, "points": points}))


if __name__ == "__main__":
    main()
