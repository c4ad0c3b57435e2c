"""`miles train sft`: flow-matching fine-tuning on an image + caption set; train-only, no engines.

Each iteration (`--num-rollout` of them) draws `global_batch_size` rows (shuffled per epoch with
`--seed`) and makes one optimizer step per `num_steps_per_rollout`. At the end the trained pipeline
is exported to `<output-dir>/checkpoint`, loadable with `from_pretrained`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from miles.io.loggers import MetricsLogger
from miles.runtime.output import export_final
from miles.runtime.progress import progress_bar
from miles.runtime.session import ray_job
from miles.runtime.train_rl import train_metrics

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


class RowSampler:
    """Rows in a fresh permutation per epoch, drawn from (--seed, epoch)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch, self.offset = size, seed, 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist()

    def take(self, n: int) -> list[int]:
        rows: list[int] = []
        while len(rows) < n:
            if self.offset == self.size:
                self.epoch, self.offset = self.epoch + 1, 0
                self.order = self._order()
            take = min(n - len(rows), self.size - self.offset)
            rows += self.order[self.offset : self.offset + take]
            self.offset += take
        return rows


def run(resolved: ResolvedJob) -> int:
    from miles.runtime.trainer_group import TrainerGroup
    from miles.training.sft_data import encode_sft_dataset

    args = resolved.trainer_args["actor"]
    with ray_job(resolved, args, manager_class=None) as job:
        start = time.perf_counter()
        data = encode_sft_dataset(args)
        print(f"miles: encoded {len(data)} SFT rows in {time.perf_counter() - start:.1f}s")
        steps_per_iter = int(args.num_steps_per_rollout or 1)
        gbs = int(args.global_batch_size)
        num_iters = int(args.num_rollout or max(1, (args.num_epoch or 1) * len(data) // (gbs * steps_per_iter)))
        group = TrainerGroup(args, "actor", num_iters * steps_per_iter, job.placement)
        job.record_placement([group])
        sampler = RowSampler(len(data), args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        logger = MetricsLogger(args, job.out, resolved.spec.name, echo=lambda line: None)
        every = max(1, num_iters // 20)
        with progress_bar("train sft", num_iters) as advance:
            for it in range(num_iters):
                metrics: dict[str, float] = {}
                for _ in range(steps_per_iter):
                    x0, samples = data.batch(sampler.take(gbs), generator)
                    metrics = train_metrics(group.train_sft(x0, samples))
                line = logger.log(it, metrics)
                advance(line if it % every == 0 or it == num_iters - 1 else "")
        logger.close()
        export_final(args, group)
    return 0
