"""Built-in SFT checkpoints of tiny-sd3 on the digits, made on first use by the tiny recipes.

`tiny-sd3-digits-sft` is the teacher (the `tiny-digits-sft` recipe's full run); the short one is an
under-trained start for RL (`tiny-digits-grpo`), so the reward has room to rise. Each is built in
this process (one gloo rank, the same Trainer as `miles train sft`), exported as a complete pipeline
and cached under `$MILES_HOME/models/<name>`.
"""

from __future__ import annotations

import socket
from pathlib import Path

SFT_TEACHERS: dict[str, int] = {
    "tiny-sd3-digits-sft": 1000,  # optimizer steps at batch 64
    "tiny-sd3-digits-sft-short": 450,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_digits_teacher(name: str, target: Path, progress: bool = True) -> Path:
    import numpy as np
    import torch
    import torch.distributed as dist

    from miles.config.resolve import resolve
    from miles.training.sft_data import encode_sft_dataset
    from miles.training.trainer import Trainer

    steps = SFT_TEACHERS[name]
    args = resolve(
        "sft",
        recipe="tiny-digits-sft",
        cli={"num_rollout": steps, "hf_checkpoint": "tiny-sd3", "output_dir": str(target.parent)},
    ).args
    data = encode_sft_dataset(args)
    owns_group = not dist.is_initialized()
    trainer = Trainer(args, 0, 1, "127.0.0.1", _free_port(), total_steps=steps)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    try:
        from rich.progress import Progress

        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"building {name} ({steps} SFT steps)", total=steps)
            for _ in range(steps):
                rows = rng.choice(len(data), int(args.global_batch_size), replace=False).tolist()
                x0, samples = data.batch(rows, generator)
                trainer.train_sft(x0, samples)
                bar.advance(task)
        trainer.export_pipeline(str(target))
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return target
