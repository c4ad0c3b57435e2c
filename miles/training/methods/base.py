"""What a training method gives the trainer.

`TrainMethod` is built once per trainer (`miles.training.methods.build_method`, from the method table). A method
that trains on rollouts (`RolloutMethod`) gives the pairs of one window (`pairs`), what makes a hook's pair unusable
to it (`pair_problem`) and one micro-batch's loss and metrics (`micro`); the base runs the loop of a rollout's
optimizer steps over them (the train-data hooks, `miles.training.custom_hooks`, may replace the cut and the
expansion). On dataset latents (`train_sft`) every method runs flow matching (`miles.training.flow_matching`) with
its `data_loss` (default: `sft_loss`). DMD2's two groups implement their own `train`. Every optimizer step goes
through the trainer's `step` (gradient accumulation, clipping, the schedule, EMA).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from miles.core.sample import Sample
from miles.training.custom_hooks import TrainHooks
from miles.training.flow_matching import Loss, flow_matching_loss, flow_matching_step
from miles.training.pairs import Pair
from miles.training.step_metrics import is_max

if TYPE_CHECKING:
    from miles.training.trainer import Trainer


class TrainMethod:
    """One `--loss-type` on one trainer. Subclasses implement the entry points their jobs call."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def args(self) -> Any:
        return self.trainer.args  # read live, as the trainer's own reads (a test swaps them between steps)

    def train(self, rollout_id: int, samples: list[Sample], *extra: Any) -> Any:
        """One rollout's training (`Trainer.train`)."""
        raise NotImplementedError(f"--loss-type {self.args.loss_type} is not trained on rollouts")

    def train_sft(self, x0: torch.Tensor, conditions: list[Sample]) -> dict[str, float]:
        """One optimizer step of flow matching on dataset latents `x0` with their samples' conditions."""
        return flow_matching_step(self.trainer, x0, conditions, self.data_loss)

    def data_loss(self, batch: list[Pair], inputs: dict[str, Any]) -> Loss:
        """The loss of one micro-batch of noised dataset latents (`inputs`: see `flow_matching_step`)."""
        return flow_matching_loss(self.trainer, batch, inputs)


class RolloutMethod(TrainMethod):
    """A method that trains on the pairs of rollout samples: the loop of one rollout's optimizer steps."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.hooks = TrainHooks(self.args)  # --custom-convert-...-path, --custom-expand-...-path

    def pairs(self, window: list[Sample]) -> list[Pair]:
        """The built-in expansion of one optimizer window into train pairs."""
        raise NotImplementedError

    def pair_problem(self, pair: Pair) -> str:
        """Why a hook's pair cannot be trained by this method ('' when it can)."""
        return ""

    def micro(self, batch: list[Pair]) -> Loss:
        """One micro-batch's loss (carrying the graph) and metrics."""
        raise NotImplementedError

    def train(self, rollout_id: int, samples: list[Sample], *extra: Any) -> dict[str, float]:
        """One rollout's optimizer steps; returns the mean metrics (names without the train/ prefix)."""
        if extra:
            raise TypeError(f"--loss-type {self.args.loss_type} trains on the samples alone, got {len(extra)} more")
        trainer = self.trainer
        start = time.perf_counter()
        if torch.cuda.is_available():  # the memory plan's check on a GPU (bench/gpu_acceptance.sh)
            torch.cuda.reset_peak_memory_stats()
        totals: dict[str, list[float]] = {}
        first_diff = None
        for pairs in self.hooks.train_data(samples, self.pairs, self.pair_problem):
            metrics = trainer.step(pairs, self.micro)
            if first_diff is None:
                first_diff = metrics.get("log_prob_mean_abs_diff")
            for k, v in metrics.items():
                totals.setdefault(k, []).append(v)
        out = {k: max(v) if is_max(k) else sum(v) / len(v) for k, v in totals.items()}
        if first_diff is not None:
            # the engine-trainer difference alone: measured before this rollout's first update, whereas
            # log_prob_mean_abs_diff averages all optimizer steps and so includes the policy's own drift
            out["log_prob_abs_diff_first_step"] = first_diff
        out["train_time"] = time.perf_counter() - start
        if torch.cuda.is_available():
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out
