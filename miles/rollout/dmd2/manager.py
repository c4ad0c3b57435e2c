"""The rollout manager of `miles train dmd2`: the student's stopped few-step rollouts, and the eval of
student and teacher (the base `RolloutManager` does the rest: data source, engines, weight sync).

`generate_dmd2(rollout_id, stop_at)` draws `rollout_batch_size` prompt groups and runs the student
(the engines' weights) on `--dmd2-student-timesteps`, stopped at step `stop_at`; no reward is
computed. `evaluate_student()` runs the full few-step sampler on the eval datasets and
`evaluate_teacher(steps)` the teacher (`--teacher-checkpoint`, CFG `--dmd2-real-guidance-scale`, the
pipeline's own ODE sampler at each step count) on an engine loaded for the occasion; both use the
eval datasets' seeds, so the same prompt gets the same initial noise in every variant.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles.core.sample import Sample
from miles.rollout.dmd2.engine import few_step_request
from miles.rollout.manager import RolloutBatch, RolloutManager, build_requests


def variant_name(dataset: str, variant: str, num_datasets: int) -> str:
    """`student_4step` for the only eval dataset, `<dataset>_student_4step` when there are several."""
    return variant if num_datasets == 1 else f"{dataset}_{variant}"


class Dmd2RolloutManager(RolloutManager):
    @property
    def student_timesteps(self) -> list[int]:
        return [int(t) for t in self.args.dmd2_student_timesteps]

    def _requests(self, groups: list[list[Sample]], stop_at: int | None) -> list[Any]:
        args = self.args
        negative = stop_at is not None and float(args.dmd2_real_guidance_scale or 1.0) > 1.0
        return [
            few_step_request(
                group[0].prompt,
                group[0].metadata,
                group[0].group_index,
                [s.index for s in group],
                [s.seed for s in group],
                timesteps=self.student_timesteps,
                stop_at=stop_at,
                negative=negative,
                height=int(args.diffusion_height),
                width=int(args.diffusion_width),
                negative_prompt=args.diffusion_negative_prompt,
            )
            for group in groups
        ]

    def run_few_step(self, requests: list[Any]) -> list[Sample]:
        """Spread the requests over the engines (round robin); each engine runs its share as one batch."""
        shards: list[list[Any]] = [[] for _ in self.engines]
        for i, request in enumerate(requests):
            shards[i % len(self.engines)].append(request)
        if self.supervisor is not None:  # a dead engine's share re-sent after its restart (fault tolerance)
            return self.supervisor.run(shards, "generate_few_step", split=False)
        if self.use_ray_engines:
            import ray

            results = ray.get([e.generate_few_step.remote(s) for e, s in zip(self.engines, shards, strict=True) if s])
        else:
            results = [e.generate_few_step(s) for e, s in zip(self.engines, shards, strict=True) if s]
        return [sample for result in results for sample in result]

    def generate_dmd2(self, rollout_id: int, stop_at: int) -> RolloutBatch:
        start = time.perf_counter()
        groups = self.data_source.get_samples(int(self.args.rollout_batch_size))
        done = {s.index: s for s in self.run_few_step(self._requests(groups, stop_at))}
        samples = [_keep_bookkeeping(s, done[s.index]) for group in groups for s in group]
        metrics = {
            "rollout/num_samples": float(len(samples)),
            "rollout/stop_step": float(stop_at),
            "perf/rollout_time": time.perf_counter() - start,
        }
        return RolloutBatch(rollout_id=rollout_id, samples=samples, metrics=metrics)

    # ---- evaluation ------------------------------------------------------------------------
    def _score(self, name: str, samples: list[Sample]) -> dict[str, float]:
        from miles.rewards.dispatch import score_samples
        from miles.rollout.evaluation import eval_metrics

        asyncio.run(score_samples(self.args, samples))
        return eval_metrics(self.args, name, samples)

    def evaluate_student(self) -> tuple[dict[str, float], dict[str, list[Sample]]]:
        """The student's n-step samples on every eval dataset: `eval/student_<n>step/...`."""
        from miles.rollout.evaluation import eval_datasets, eval_groups

        datasets = eval_datasets(self.args)
        metrics: dict[str, float] = {}
        by_name: dict[str, list[Sample]] = {}
        variant = f"student_{len(self.student_timesteps)}step"
        for dataset in datasets:
            groups = eval_groups(self.args, dataset)
            done = {s.index: s for s in self.run_few_step(self._requests(groups, None))}
            samples = [_keep_bookkeeping(s, done[s.index]) for group in groups for s in group]
            name = variant_name(dataset.name, variant, len(datasets))
            metrics.update(self._score(name, samples))
            by_name[name] = samples
        return metrics, by_name

    def teacher_args(self) -> Any:
        args = self.args
        values = {
            "hf_checkpoint": args.teacher_checkpoint or args.hf_checkpoint,
            "diffusion_guidance_scale": float(args.dmd2_real_guidance_scale or args.diffusion_guidance_scale),
        }
        return args.with_values(values, "derived")

    def evaluate_teacher(self, steps: list[int]) -> tuple[dict[str, float], dict[str, list[Sample]]]:
        """The teacher at each step count of `steps` on every eval dataset: `eval/teacher_<n>step/...`."""
        from miles.rollout.evaluation import eval_datasets, eval_groups

        targs = self.teacher_args()
        engine, call = self._teacher_engine(targs)
        datasets = eval_datasets(self.args)
        metrics: dict[str, float] = {}
        by_name: dict[str, list[Sample]] = {}
        try:
            for dataset in datasets:
                for num_steps in steps:
                    groups = eval_groups(targs, dataset)
                    requests = build_requests(targs, groups, self.strategy, evaluation=True)
                    for request in requests:
                        request.num_steps = int(num_steps)
                    done = {s.index: s for s in call(requests)}
                    samples = [_keep_bookkeeping(s, done[s.index]) for group in groups for s in group]
                    name = variant_name(dataset.name, f"teacher_{num_steps}step", len(datasets))
                    metrics.update(self._score(name, samples))
                    by_name[name] = samples
        finally:
            if self.use_ray_engines:
                import ray

                ray.get(engine.drop_guest.remote())
        return metrics, by_name

    def _teacher_engine(self, targs: Any) -> tuple[Any, Any]:
        """The teacher's sampler: in-process, a second engine; on Ray, a guest pipeline inside engine 0's
        actor, so it runs on that engine's GPU and needs no place of its own in the plan."""
        if not self.use_ray_engines:
            from miles.rollout.engines.diffusers_engine import DiffusersEngine

            engine = DiffusersEngine(targs)
            return engine, engine.generate
        import ray

        engine = self.engines[0]
        return engine, lambda requests: ray.get(engine.generate_guest.remote(targs, requests))


def _keep_bookkeeping(planned: Sample, done: Sample) -> Sample:
    done.index, done.group_index, done.metadata = planned.index, planned.group_index, planned.metadata
    return done


def manager_actor_class() -> Any:
    from miles.utils.actors import owned_remote

    return owned_remote(Dmd2RolloutManager)
