"""Build a built-in digits SFT checkpoint (`tiny-sd3-digits-sft`, the short RL start points): the
Trainer of `miles train sft` on one gloo rank in this process, exported as a complete pipeline and
stamped with its step count. Names and step counts: `miles.models.digits_teachers`."""

from __future__ import annotations

import socket
from pathlib import Path

from miles.models.digits_teachers import SFT_TEACHERS, STAMP_FILE, TEACHER_SOURCES
from miles.models.tiny.metadata import current_design


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_digits_teacher(name: str, target: Path, progress: bool = True) -> Path:
    import json

    import numpy as np
    import torch
    import torch.distributed as dist

    from miles.config.resolve import resolve
    from miles.training.sft_data import encode_sft_dataset
    from miles.training.trainer import Trainer
    from miles.utils.atomic import atomic_write_text

    steps = SFT_TEACHERS[name]
    recipe, base = TEACHER_SOURCES[name]
    args = resolve(
        "sft", recipe=recipe, cli={"num_rollout": steps, "hf_checkpoint": base, "output_dir": str(target.parent)}
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
        stamp = {"name": name, "sft_steps": steps, "recipe": recipe, "base": base, "base_design": current_design(base)}
        atomic_write_text(target / STAMP_FILE, json.dumps(stamp, indent=2) + "\n")
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return target
