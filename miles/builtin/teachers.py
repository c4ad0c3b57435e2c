"""Built-in SFT checkpoints of the tiny families on the digits, made on first use by the tiny recipes.

Names, step counts and stamps are torch-free; the build (`build_digits_teacher`) runs the Trainer of
`miles train sft` on one gloo rank in this process (imported when it runs).

`tiny-sd3-digits-sft` is the teacher (the `tiny-digits-sft` recipe's full run); the short one is an
under-trained start for RL (`tiny-digits-grpo`), so the reward has room to rise. Each is built in
this process (one gloo rank, the same Trainer as `miles train sft`), exported as a complete pipeline
and cached under `$MILES_HOME/models/<name>`, stamped with its step count (`digits_teacher.json`):
a cached copy made with another step count is rebuilt.

The short start sits where the SFT reward curve turns steep (measured, 10-step SDE rollouts of
`digits:labels` at CFG 4: 450 steps 0.32, 525 steps 0.37, 600 steps 0.54, 675 steps 0.71, 750
steps 0.94): there the digit reward responds to RL within a few dozen optimizer steps, while from
450 steps even SFT on the real images gains only +0.06 in 80 steps.
"""

from __future__ import annotations

import socket
from pathlib import Path

from miles.builtin.names import SFT_TEACHERS
from miles.models.tiny.metadata import current_design

# name -> (the SFT recipe that makes it, its base checkpoint)
TEACHER_SOURCES: dict[str, tuple[str, str]] = {
    "tiny-sd3-digits-sft": ("tiny-digits-sft", "tiny-sd3"),
    "tiny-sd3-digits-sft-short": ("tiny-digits-sft", "tiny-sd3"),
    "tiny-flux-digits-sft-short": ("tiny-flux-digits-sft", "tiny-flux"),
    "tiny-flux2-klein-digits-sft-short": ("tiny-flux2-klein-digits-sft", "tiny-flux2-klein"),
    "tiny-z-image-digits-sft-short": ("tiny-z-image-digits-sft", "tiny-z-image"),
    "tiny-qwen-image-digits-sft-short": ("tiny-qwen-image-digits-sft", "tiny-qwen-image"),
    "tiny-wan2_2-digits-sft-short": ("tiny-wan2_2-digits-sft", "tiny-wan2_2"),
    "tiny-cosmos3-digits-sft-short": ("tiny-cosmos3-digits-sft", "tiny-cosmos3"),
    "tiny-ltx2-digits-sft-short": ("tiny-ltx2-digits-sft", "tiny-ltx2"),
    "tiny-flux-kontext-edit-sft-short": ("tiny-flux-kontext-edit-sft", "tiny-flux-kontext"),
    "tiny-qwen-image-edit-sft-short": ("tiny-qwen-image-edit-sft", "tiny-qwen-image-edit"),
    "tiny-wan2_2-i2v-digits-sft-short": ("tiny-wan2_2-i2v-sft", "tiny-wan2_2-i2v"),
    "tiny-wan2_2-ti2v-digits-sft-short": ("tiny-wan2_2-ti2v-sft", "tiny-wan2_2-ti2v"),
}
STAMP_FILE = "digits_teacher.json"
# copies made before the stamp existed
_UNSTAMPED_STEPS = {"tiny-sd3-digits-sft": 1000, "tiny-sd3-digits-sft-short": 450}


def _stamp(path: Path) -> dict | None:
    """A cached teacher's stamp (None: absent); an unreadable one is {} (so every field reads as unknown)."""
    import json

    stamp = path / STAMP_FILE
    if not stamp.is_file():
        return None
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def built_steps(path: Path, name: str) -> int | None:
    """The SFT step count a cached teacher was built with (None: unknown)."""
    stamp = _stamp(path)
    if stamp is None:
        return _UNSTAMPED_STEPS.get(name)
    try:
        return int(stamp["sft_steps"])
    except (KeyError, TypeError, ValueError):
        return None


def built_base_design(path: Path) -> int:
    """The design of the tiny build a cached teacher was trained from (1 when its stamp predates the field)."""
    try:
        return int((_stamp(path) or {}).get("base_design", 1))
    except (TypeError, ValueError):
        return 1


def is_current(path: Path, name: str) -> bool:
    """Built with today's step count, from a base of today's design."""
    base = TEACHER_SOURCES[name][1]
    return built_steps(path, name) == SFT_TEACHERS[name] and built_base_design(path) == current_design(base)


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
