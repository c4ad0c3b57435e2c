"""`miles train sft`: flow-matching fine-tuning on an image + caption set (or offline DPO on preference rows, as
the method table's `sft_rows` says: `encode_train_rows`); train-only, no engines.

Each iteration (`--num-rollout` of them) draws `global_batch_size` rows (shuffled per epoch with
`--seed`) and makes one optimizer step per `num_steps_per_rollout`. At the end the trained pipeline
is exported to `<output-dir>/checkpoint`, loadable with `from_pretrained`.

Checkpoints and resume work as in `train rl` (`miles.training.checkpoint`): `--save`/`--save-interval`
write the trainer state plus the data order (the row sampler's epoch and offset, and the caption-dropout
generator, restored unless --no-load-rng) under `extra.json`'s `sft`; `--load` resumes at the next
iteration, so 2 iterations + resume to 4 trains the same weights as 4 straight. `--eval-interval N`
evaluates every N iterations (before iteration 0 unless --skip-eval-before-train, and at the end) with
the rollout manager's `evaluate`, the one `train rl` and `miles eval` use, on one in-process diffusers
engine made at the first eval (this job reserves no engine GPUs) and given the trained weights first.
"""

from __future__ import annotations

import base64
import copy
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from miles.config.eval_schedule import evaluates
from miles.core.errors import ConfigError
from miles.io.dashboard import open_dashboard
from miles.io.loggers import MetricsLogger
from miles.runtime.ci_check import ci_check
from miles.runtime.output import export_at, export_due, export_final
from miles.runtime.progress import progress_bar
from miles.runtime.session import ray_job
from miles.runtime.train_rl import eval_due, save_due, train_metrics

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

    def state_dict(self) -> dict[str, int]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["size"]) != self.size:
            raise ConfigError(
                f"--load: the checkpoint was trained on {state['size']} SFT rows, --prompt-data has {self.size}"
            )
        self.seed, self.epoch, self.offset = int(state["seed"]), int(state["epoch"]), int(state["offset"])
        self.order = self._order()


def encode_train_rows(args: Any) -> Any:
    """The rows the method trains on, as the method table's `sft_rows` says: image (or video) + caption rows
    (`miles.training.sft_data.SFTDataset`) or preference rows (`miles.training.preference_data.PreferenceDataset`).
    Both give `len()` and `batch(rows, generator) -> (x0, samples)`."""
    from miles.methods import method

    if method(args.loss_type).sft_rows == "preference":
        from miles.training.preference_data import encode_preference_dataset

        return encode_preference_dataset(args)
    from miles.training.sft_data import encode_sft_dataset

    return encode_sft_dataset(args)


def run(resolved: ResolvedJob) -> int:
    from miles.runtime.trainer_group import TrainerGroup

    args = resolved.trainer_args["actor"]
    with ray_job(resolved, args, manager_class=None) as job:
        dash = open_dashboard(args, resolved.spec.name, resolved.recipe)
        start = time.perf_counter()
        with dash.span("encode"):
            data = encode_train_rows(args)  # image + caption rows, or preference rows (offline DPO)
        print(f"miles: encoded {len(data)} SFT rows in {time.perf_counter() - start:.1f}s")
        steps_per_iter = int(args.num_steps_per_rollout or 1)
        gbs = int(args.global_batch_size)
        num_iters = int(args.num_rollout or max(1, (args.num_epoch or 1) * len(data) // (gbs * steps_per_iter)))
        group = TrainerGroup(args, "actor", num_iters * steps_per_iter, job.placement)
        job.record_placement([group])
        sampler = RowSampler(len(data), args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        first = resume(args, group, sampler, generator)
        evaluator = SftEval(args, job.out, group, dash)
        logger = MetricsLogger(args, job.out, resolved.spec.name, echo=lambda line: None)
        every = max(1, num_iters // 20)
        with progress_bar("train sft", max(0, num_iters - first)) as advance:
            for it in range(first, num_iters):
                metrics: dict[str, float] = {}
                if eval_due(args, it, first):
                    metrics.update(evaluator(it))
                with dash.span("train", rollout_id=it):
                    for _ in range(steps_per_iter):
                        x0, samples = data.batch(sampler.take(gbs), generator)
                        metrics.update(train_metrics(group.train_sft(x0, samples)))
                evaluator.trained = True
                line = logger.log(it, metrics)
                advance(line if it % every == 0 or it == num_iters - 1 or "eval/" in line else "")
                if save_due(args, it, num_iters):
                    with dash.span("save", rollout_id=it):
                        save(args, group, it, sampler, generator)
                if export_due(args, it, num_iters):
                    with dash.span("export", rollout_id=it):
                        export_at(args, group, it + 1, unit="iter")
        if evaluates(args, "sft") and first < num_iters:  # eval data: always after the last iteration
            logger.log(num_iters, evaluator(num_iters))
        logger.close()
        with dash.span("export"):
            export_final(args, group)
        dash.close()
    print(f"miles: train sft finished {max(0, num_iters - first)} iterations; metrics in {job.out / 'metrics.jsonl'}")
    return ci_check(args, job.out, job.metrics_start)


def _generator_state(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _set_generator_state(generator: torch.Generator, text: str) -> None:
    raw = bytearray(base64.b64decode(text))
    generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())


def save(args: Any, group: Any, it: int, sampler: RowSampler, generator: torch.Generator) -> None:
    """The trainer state (`Trainer.save_checkpoint`) with the data order in `extra.json`."""
    sft = {"sampler": sampler.state_dict(), "generator": _generator_state(generator)}
    group.call("save_checkpoint", args.save, it, {"rollout_id": it, "sft": sft})


def resume(args: Any, group: Any, sampler: RowSampler, generator: torch.Generator) -> int:
    """Restore `--load` (trainer state, row order, caption-dropout generator unless --no-load-rng); the first
    iteration to run (`--start-rollout-id` wins, as in `train rl`)."""
    first = 0
    if args.load:
        extra = group.call("load_checkpoint", args.load, args.ckpt_step)[0]
        first = int(extra["rollout_id"]) + 1
        sft = extra.get("sft") or {}
        if sft.get("sampler"):
            sampler.load_state_dict(sft["sampler"])
        if sft.get("generator") and not args.no_load_rng:
            _set_generator_state(generator, sft["generator"])
    if args.start_rollout_id is not None:
        first = int(args.start_rollout_id)
    return first


class SftEval:
    """`--eval-interval`: the eval datasets through `RolloutManager.evaluate` on one in-process engine (made on
    first use), which gets the trainer's weights whenever they changed since its last eval."""

    def __init__(self, args: Any, out: Any, group: Any, dash: Any = None) -> None:
        from miles.io.dashboard import NullDashboard

        self.args, self.out, self.group = args, out, group
        self.dash = dash or NullDashboard()
        self.manager: Any = None
        self.trained = bool(args.load)  # the engine loads --hf-checkpoint: a resumed trainer differs from it

    def __call__(self, it: int) -> dict[str, float]:
        from miles.rollout.manager import RolloutManager
        from miles.rollout.rollout_hooks import log_eval
        from miles.runtime.eval_job import save_eval_grids

        if self.manager is None:
            eval_args = copy.copy(self.args)
            eval_args.rollout_backend = "diffusers"  # never an sglang server here ("auto" on a GPU machine)
            self.manager = RolloutManager(eval_args)
        if self.trained:
            with self.dash.span("sync", rollout_id=it):
                self.manager.update_weights(self.group.weights_for_sync(), it)
            self.trained = False
        start = time.perf_counter()
        with self.dash.span("eval", rollout_id=it):
            metrics, by_name = self.manager.evaluate(it)
        if log_eval(self.args, it, by_name, metrics):  # --custom-eval-rollout-log-function-path took over
            return {"perf/eval_time": time.perf_counter() - start}
        save_eval_grids(self.args, self.out, by_name, tag=f"_{it}")
        return {**metrics, "perf/eval_time": time.perf_counter() - start}
