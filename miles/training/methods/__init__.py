"""The training methods, one module each (the `impl` of their entry in `miles.methods`).

A method is what the trainer does with its data: the pairs it trains on from a window of rollout samples and one
micro-step's loss (`flow_grpo`, `nft`, `custom`), a step of flow matching on dataset latents (`sft`, `custom`), or
DMD2's student and critic (`dmd2`). The trainer (`miles.training.trainer`) keeps the engine: load, LoRA, FSDP2, the
velocity, the reference, the optimizer step, weights out, checkpoints, offload. It builds its method once, from the
table, and reaches it through `TrainMethod` only; the formulas stay in `miles.algorithms`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.methods import method
from miles.utils.hooks import load_class

if TYPE_CHECKING:
    from miles.training.methods.base import TrainMethod
    from miles.training.trainer import Trainer


def build_method(trainer: Trainer) -> TrainMethod:
    """The trainer's method: the table's `impl` for `--loss-type`, on this trainer."""
    entry = method(trainer.args.loss_type)
    cls = load_class(entry.impl, f"--loss-type {entry.name}")
    return cls(trainer)
