"""Adding a method is one module under `miles/training/methods/` (here: a class in this test), one entry of the
method table and its tests: the trainer reaches it through the table only.

The toy method, advantage-weighted flow matching on the rollout's final latents at one noise level, is added to
the table for this test alone and trains one optimizer step of a real tiny-sd3 trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.config.args import override_source
from miles.core.sample import Sample
from miles.methods import METHODS, Method
from miles.training.methods.base import Loss, RolloutMethod
from miles.training.pairs import Pair
from miles.training.trainer import Trainer

pytestmark = pytest.mark.slow

SIGMA = 0.5


class ToyMethod(RolloutMethod):
    """One pair per kept sample: its final latent, noised to SIGMA; the loss is the advantage-weighted flow-matching
    error of the unguided velocity."""

    seen: ClassVar[list[int]] = []

    def pairs(self, window: list[Sample]) -> list[Pair]:
        kept = [s for s in window if not s.remove_sample and s.trajectory is not None]
        self.seen.append(len(kept))
        return [Pair(s, 0, -1, SIGMA) for s in kept]

    def pair_problem(self, pair: Pair) -> str:
        return "" if pair.sample.trajectory is not None else "its sample has no trajectory"

    def micro(self, batch: list[Pair]) -> Loss:
        samples = [p.sample for p in batch]
        x0 = torch.stack([s.trajectory.latents[-1] for s in samples]).float()
        noise = torch.randn(x0.shape, generator=self.trainer.generator)
        x_t = (1 - SIGMA) * x0 + SIGMA * noise
        v = self.trainer.velocity(x_t, torch.full((len(batch),), SIGMA * 1000.0), samples, None)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        err = (v.float() - (noise - x0)).pow(2).flatten(1).mean(1)
        loss = (adv.clamp(min=0) * err).mean() + 1e-3 * err.mean()
        return loss, {"loss": float(loss.detach()), "toy_fm_error": float(err.detach().mean())}


def test_a_toy_method_is_one_class_and_one_table_entry(tiny_sd3_dir: Path, rollout, monkeypatch) -> None:
    _, batch = rollout
    entry = Method("toy", "a toy method", jobs=("rl",), impl=f"{__name__}:ToyMethod", on_rollouts=True)
    monkeypatch.setitem(METHODS, "toy", entry)
    args = trainer_args(tiny_sd3_dir, lr=1e-3).with_values({"loss_type": "toy"}, override_source("test"))
    trainer = Trainer(args, master_port=free_port())
    assert type(trainer.method) is ToyMethod

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train(0, batch.samples)
    assert ToyMethod.seen == [len(batch.samples)]  # one window of 8 samples: one pair each
    assert trainer.global_step == 1 and metrics["grad_norm"] > 0
    assert metrics["toy_fm_error"] > 0 and metrics["loss"] > 0
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved  # the step moved the weights
