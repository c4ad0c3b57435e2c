"""One optimizer step of the trainer (`Trainer.step`) and the flags it reads: --clip-grad, --train-dp-split-mode,
--micro-batch-size and the 2D micro-batch tile with --diffusion-train-iter-order.

Fast: the step runs on a trainer shell around one plain parameter (SGD, lr 1, so the update is the clipped
gradient), with a recording micro-batch function standing in for the loss.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.core.sample import Sample
from miles.training.pairs import Pair
from miles.training.trainer import Trainer


class ConstantSchedule:
    def step(self) -> None:
        pass

    def get_lr(self) -> float:
        return 1.0


@pytest.fixture(scope="module", autouse=True)
def _import_torch_optim() -> None:
    """torch.optim's first optimizer imports torch._dynamo (about 1 s on CPU); pay it once, outside the tests."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


@pytest.fixture(scope="module")
def base_args() -> Any:
    return resolve("rl", recipe="tiny-digits-grpo").args


def shell(args: Any, dp_rank: int = 0, dp_size: int = 1) -> Trainer:
    """A trainer with only what `step` uses: one parameter of 4 zeros, SGD at lr 1."""
    trainer = Trainer.__new__(Trainer)
    trainer.args, trainer.dp_rank, trainer.dp_size, trainer.world_size = args, dp_rank, dp_size, 1
    trainer.params = [torch.nn.Parameter(torch.zeros(4))]
    trainer.optimizer = torch.optim.SGD(trainer.params, lr=1.0)
    trainer.scheduler, trainer.scaler, trainer.ema, trainer.global_step = ConstantSchedule(), None, None, 0
    return trainer


def pairs(num_samples: int, steps: int) -> list[Pair]:
    samples = [Sample(index=i, group_index=0, prompt="p") for i in range(num_samples)]
    return [Pair(sample, step, step) for sample in samples for step in range(steps)]


def recording(trainer: Trainer, gradient: torch.Tensor | None = None):
    """A micro-batch function whose loss has gradient `gradient` (zeros by default); records its batches."""
    seen: list[list[Pair]] = []
    gradient = torch.zeros(4) if gradient is None else gradient

    def micro(batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(list(batch))
        return (trainer.params[0] * gradient).sum(), {}

    return micro, seen


@pytest.mark.parametrize(("clip", "norm_after"), [(1.0, 1.0), (10.0, 10.0), (100.0, 50.0)])
def test_clip_grad_caps_the_gradient_norm_of_a_step(base_args: Any, clip: float, norm_after: float) -> None:
    trainer = shell(base_args.with_values({"clip_grad": clip}, "cli"))
    micro, _ = recording(trainer, torch.tensor([30.0, 40.0, 0.0, 0.0]))  # a gradient of norm 50
    metrics = trainer.step(pairs(1, 1), micro)
    assert metrics["grad_norm"] == pytest.approx(50.0)  # reported before clipping
    update = trainer.params[0].detach()
    assert update.norm().item() == pytest.approx(norm_after)
    assert update[:2].tolist() == pytest.approx([-0.6 * norm_after, -0.8 * norm_after])  # the direction stays
    assert trainer.global_step == 1


@pytest.mark.parametrize(("mode", "expected"), [("contiguous", [3, 4, 5]), ("stride", [1, 3, 5])])
def test_train_dp_split_mode_deals_the_pairs_to_the_ranks(base_args: Any, mode: str, expected: list[int]) -> None:
    trainer = shell(base_args.with_values({"train_dp_split_mode": mode, "micro_batch_size": 8}, "cli"), 1, 2)
    micro, seen = recording(trainer)
    window = pairs(6, 1)
    trainer.step(window, micro)
    assert [[window.index(p) for p in batch] for batch in seen] == [expected]  # rank 1 of 2


def test_micro_batch_size_cuts_a_ranks_pairs(base_args: Any) -> None:
    trainer = shell(base_args.with_values({"micro_batch_size": 3}, "cli"))
    micro, seen = recording(trainer)
    trainer.step(pairs(7, 1), micro)
    assert [len(batch) for batch in seen] == [3, 3, 1]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("sample_major", [("01", "012"), ("01", "3"), ("2", "012"), ("2", "3")]),
        ("timestep_major", [("01", "012"), ("2", "012"), ("01", "3"), ("2", "3")]),
    ],
)
def test_2d_tiles_follow_the_tile_and_the_iter_order(base_args: Any, order: str, expected: list) -> None:
    tile = {"micro_batch_size_sample": 2, "micro_batch_size_tstep": 3, "diffusion_train_iter_order": order}
    trainer = shell(base_args.with_values(tile, "cli"))
    micro, seen = recording(trainer)
    trainer.step(pairs(3, 4), micro)  # 3 samples x 4 recorded steps, listed sample-major
    tiles = [
        (
            "".join(str(i) for i in sorted({p.sample.index for p in batch})),
            "".join(str(s) for s in sorted({p.step for p in batch})),
        )
        for batch in seen
    ]
    assert tiles == expected
    assert all(len(batch) == len(samples) * len(steps) for batch, (samples, steps) in zip(seen, tiles, strict=True))
