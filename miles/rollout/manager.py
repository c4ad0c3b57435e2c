"""The rollout manager: phases 1-2 of the loop (sample, score) for one rollout id.

It owns the data source, the engines and the reward scorers. `generate(rollout_id)` draws
`rollout_batch_size` prompt groups, splits every group into microgroups of at most
`--rollout-microgroup-size` samples (one engine request each, seeds from the documented layout),
spreads the requests over the engines, scores the samples, applies the filters and computes the
GRPO advantages. It runs in-process or as a Ray actor (`manager_actor_class`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from miles.core.sample import Sample
from miles.rollout import rollout_hooks
from miles.rollout.data_source import load_data_source
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.rollout_batch import PREVIEW_SAMPLES, RolloutBatch, without_images  # noqa: F401 (imported from here)
from miles.sampling.step_strategies import resolve_step_strategy, select_steps
from miles.utils.buckets import chunk_state_dict


def trained_expert_steps(args: Any, num_steps: int) -> list[int] | None:
    """The steps whose transitions the trained experts make, when the family has experts and only some of them
    train (`--update-weight-target-module`); None otherwise (every step may be drawn)."""
    from miles.models.families import resolve_family

    family = resolve_family(
        args.hf_checkpoint,
        family=args.diffusion_model_family,
        config_path=args.train_pipeline_config_path,
        require_trainable=False,
    )
    from miles.models.pipeline_config import target_components

    components = target_components(args.update_weight_target_module)
    if not family.experts or set(family.experts) <= set(components):
        return None
    import json

    import diffusers

    from miles.core.inputs import input_path

    checkpoint = input_path(args, args.hf_checkpoint)
    family.bind_checkpoint(checkpoint)
    config = json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text())
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    sigmas, timesteps = family.schedule(scheduler, num_steps, (1, 1, 1, 1), args.diffusion_flow_shift)
    return family.trainable_steps(sigmas, timesteps, components)


def build_requests(
    args: Any,
    groups: list[list[Sample]],
    strategy: Any,
    evaluation: bool = False,
    allowed_steps: list[int] | None = None,
    rollout_id: int | None = None,
) -> list[GenerateRequest]:
    """One request per microgroup, in batch order; `allowed_steps` confines the SDE steps (trained experts);
    `rollout_id` is the rollout being sampled (a strategy reads it as `args.rollout_id`). Under
    `--diffusion-shared-prefix` or `--diffusion-post-sde-steps-ratio` the strategy draws once per microgroup, with
    its first sample's seed, and every sample of the microgroup takes those steps."""
    size = max(1, int(args.rollout_microgroup_size))
    per_microgroup = bool(args.diffusion_shared_prefix) or args.diffusion_post_sde_steps_ratio is not None
    num_steps = (
        int(args.diffusion_eval_num_steps or args.diffusion_num_steps) if evaluation else int(args.diffusion_num_steps)
    )
    requests: list[GenerateRequest] = []
    for group in groups:
        for start in range(0, len(group), size):
            micro = group[start : start + size]
            deterministic = args.diffusion_sde_type == "ode" or float(args.diffusion_noise_level) == 0.0
            if evaluation or deterministic:  # no stochastic step: nothing for a strategy to choose
                sde_steps: list[list[int]] = [[] for _ in micro]
            elif per_microgroup:
                steps = select_steps(args, micro[0], num_steps, micro[0].seed, strategy, allowed_steps, rollout_id)[0]
                sde_steps = [list(steps) for _ in micro]
            else:
                sde_steps = [
                    select_steps(args, s, num_steps, s.seed, strategy, allowed_steps, rollout_id)[0] for s in micro
                ]
            requests.append(
                GenerateRequest(
                    prompt=micro[0].prompt,
                    metadata=micro[0].metadata,
                    group_index=micro[0].group_index,
                    indices=[s.index for s in micro],
                    seeds=[s.seed for s in micro],
                    sde_steps=sde_steps,
                    num_steps=num_steps,
                    guidance_scale=float(args.diffusion_guidance_scale),
                    noise_level=0.0 if evaluation else float(args.diffusion_noise_level),
                    sde_type="ode" if evaluation else args.diffusion_sde_type,
                    height=int(args.diffusion_height),
                    width=int(args.diffusion_width),
                    negative_prompt=args.diffusion_negative_prompt,
                    evaluation=evaluation,
                    true_cfg_scale=args.diffusion_true_cfg_scale,
                    num_frames=int(args.diffusion_output_num_frames),
                    fps=None if args.diffusion_fps is None else float(args.diffusion_fps),
                    guidance_scale_2=None
                    if args.diffusion_guidance_scale_2 is None
                    else float(args.diffusion_guidance_scale_2),
                    debug=bool(args.diffusion_debug_mode) and not evaluation,
                    record_means=bool(args.diffusion_grpo_guard) and not evaluation,
                    shared_prefix=bool(args.diffusion_shared_prefix) and not evaluation,
                    ode_solver="euler" if evaluation else args.diffusion_ode_solver,
                    post_sde_steps_ratio=None if evaluation else args.diffusion_post_sde_steps_ratio,
                    media=tuple(micro[0].media),
                )
            )
    return requests


class RolloutManager:
    """`placement` (a `miles.placement.ray_placement.RayPlacement`) puts the engine and reward actors where the
    job's plan says; without it (tests, benches) Ray actors get no GPU."""

    def __init__(
        self,
        args: Any,
        engines: list[Any] | None = None,
        use_ray_engines: bool = False,
        placement: Any = None,
        started: list[Any] | None = None,
    ) -> None:
        """`engines`: in-process engines to use; `use_ray_engines`: engine actors in the slots of `placement`,
        `started` by the driver already (`miles.rollout.engines.engine_start`) or started here."""
        self.args = args
        self.placement = placement
        self._data_source: Any = None
        self.strategy = resolve_step_strategy(args)
        self.use_ray_engines = use_ray_engines
        self.sglang: Any = None  # SglangRollout under --rollout-backend sglang
        self.supervisor: Any = None  # EngineSupervisor of the diffusers engine actors (health, restarts)
        # when the last call of `run_requests` had every sample generated (its scoring may end later)
        self.generation_end: float | None = None
        self.engines = engines if engines is not None else self._make_engines(started)
        if use_ray_engines:
            self._make_reward_pools()

    @property
    def data_source(self) -> Any:
        """Built on first use: `miles eval` needs none."""
        if self._data_source is None:
            self._data_source = load_data_source(self.args)
        return self._data_source

    def _make_reward_pools(self) -> None:
        """Ray actor pools for the model-backed rewards in use (OCR, PickScore); cheap ones score in-process."""
        from miles.rewards.pool import POOLED_RM_TYPES, make_reward_pools, reward_types_in_use

        source = self.data_source if self.args.prompt_data else None
        metadata = [record.metadata for record in getattr(source, "dataset", [])]
        pooled = [t for t in reward_types_in_use(self.args, metadata) if t in POOLED_RM_TYPES]
        if pooled:
            make_reward_pools(self.args, pooled, placement=self.placement)

    def engine_options(self, i: int) -> dict[str, Any]:
        """Ray options of engine i (`miles.rollout.engines.engine_start`), for a restart from here."""
        from miles.rollout.engines.engine_start import engine_options

        return engine_options(self.args, self.placement, i)

    def engine_slot(self, i: int) -> str:
        """Where engine i runs, for messages: "node 0, GPU 3" ("node 0, CPU" on a CPU cluster)."""
        from miles.rollout.engines.engine_start import engine_slot

        return engine_slot(self.placement, i)

    def _make_engines(self, started: list[Any] | None = None) -> list[Any]:
        from miles.placement.plan import num_engines

        num = len(self.placement.slots("engine")) if self.placement is not None else num_engines(self.args)
        if self.args.rollout_backend == "sglang":
            from miles.rollout.engines.sglang.rollout import SglangRollout

            self.sglang = SglangRollout(self.args, num, self.placement)
            return self.sglang.engines
        if not self.use_ray_engines:
            from miles.rollout.engines.diffusers_engine import DiffusersEngine

            return [DiffusersEngine(self.args) for _ in range(num)]
        from miles.rollout.engines.supervisor import EngineSupervisor

        # started and waited for (a load error names the engine), health-checked, restarted under fault tolerance
        self.supervisor = EngineSupervisor(self.args, num, self.engine_options, self.engine_slot, started=started)
        return self.supervisor.engines  # the supervisor's list: a restart replaces its entry

    # ---- offload between phases (--offload-rollout) --------------------------------------------
    def offload_engines(self) -> float:
        """Every engine releases its weights (sglang: /release_memory_occupation); bytes moved."""
        return self._engines_call("offload")

    def onload_engines(self) -> float:
        """Every engine takes its weights back (sglang: /resume_memory_occupation); bytes moved."""
        return self._engines_call("onload")

    def _engines_call(self, method: str) -> float:
        if self.sglang is not None:
            return float(getattr(self.sglang, method)())
        if self.supervisor is not None:
            results = self.supervisor.call_all(method)
        elif self.use_ray_engines:
            import ray

            results = ray.get([getattr(e, method).remote() for e in self.engines])
        else:
            results = [getattr(e, method)() for e in self.engines]
        return float(sum(r["bytes"] for r in results))

    def placement_info(self) -> dict[str, list[dict[str, Any]]]:
        """What each engine and GPU reward worker sees of its placement (node, Ray GPU ids,
        CUDA_VISIBLE_DEVICES, device): {"engine": [...], "reward": [...]}, in slot order."""
        from miles.rewards.dispatch import get_reward_pools

        if self.sglang is not None:
            engines = self.sglang.placement_info()
        elif self.supervisor is not None:
            engines = self.supervisor.call_all("placement_info")
        elif self.use_ray_engines:
            import ray

            engines = ray.get([e.placement_info.remote() for e in self.engines])
        else:
            engines = [e.placement_info() for e in self.engines]
        pool = get_reward_pools().get("pickscore")
        rewards = pool.placement_info() if pool is not None else []
        return {"engine": engines, "reward": rewards}

    # ---- queries ---------------------------------------------------------------------------
    def num_rollout(self) -> int:
        return self.data_source.num_rollout()

    def data_source_state(self) -> dict[str, Any]:
        return self.data_source.state_dict()

    def load_data_source_state(self, state: dict[str, Any]) -> None:
        self.data_source.load_state_dict(state)

    # ---- phase 4: weight sync -------------------------------------------------------------
    def update_weights(self, state: dict[str, Any], version: int) -> int:
        """Push `state` to every engine in chunks of `--update-weight-buffer-size` bytes; returns tensors sent."""
        self._in_place_metrics: dict[str, float] = {}
        if self.sglang is not None:
            return self.sglang.update_weights(state, version)
        if self.supervisor is not None:  # a dead engine is handled; under fault tolerance the state is kept
            return self.supervisor.sync(self._push_weights, state, version)
        return self._push_weights(state, version)

    def _push_weights(self, state: dict[str, Any], version: int) -> int:
        chunks = chunk_state_dict(state, int(self.args.update_weight_buffer_size))
        sent = 0
        for chunk in chunks:
            if self.use_ray_engines:
                import ray

                sent = sum(ray.get([e.update_weights.remote(chunk, version) for e in self.engines])) // len(
                    self.engines
                )
            else:
                sent = sum(e.update_weights(chunk, version) for e in self.engines) // len(self.engines)
        return len(state) if chunks else sent

    def sync_metrics(self) -> dict[str, float]:
        """What the last weight sync measured (sglang engines: tensors verified, engines agreeing; an
        in-place sync: tensors and bytes passed by handle)."""
        if self.sglang is not None:
            return dict(self.sglang.sync_metrics)
        return dict(getattr(self, "_in_place_metrics", {}))

    def engine_handles(self) -> list[Any]:
        """The engine actors, in engine order, for the in-place sync under --colocate (trainer rank
        i * --rollout-num-gpus-per-engine feeds engine i); empty when the engines run in this process."""
        if self.sglang is not None:
            return list(self.sglang.engines)
        if self.supervisor is not None:
            self.supervisor.recover()  # a dead engine is restarted (or the error raised) before the trainer feeds it
        return list(self.engines) if self.use_ray_engines else []

    def in_place_engines(self) -> list[Any]:
        """The engines a sync passes the weights by handle: under --colocate (trainer and engine share a
        device) the engine actors, else none (the weights go through Ray's object store)."""
        return self.engine_handles() if self.args.colocate else []

    def in_place_synced(self, version: int, metrics: dict[str, float]) -> None:
        """The trainer passed every engine the weights of `version` by handle (`TrainerGroup.sync_in_place`):
        keep its metrics for `sync_metrics`; sglang engines must also agree with each other."""
        if self.sglang is not None:
            self.sglang.in_place_synced(version, metrics)
        if self.supervisor is not None:
            self.supervisor.in_place_synced(version)
        self._in_place_metrics = dict(metrics)

    def engine_info(self) -> list[dict[str, Any]]:
        """Per engine: url, pid, log, start seconds, restarts (sglang engines); pid and slot (diffusers actors)."""
        if self.supervisor is not None:
            return [{"pid": pid, "slot": self.engine_slot(i)} for i, pid in enumerate(self.supervisor.pids)]
        if self.sglang is None:
            return []
        return [dict(info) for info in self.sglang.infos]

    def restart_log(self) -> list[dict[str, Any]]:
        if self.supervisor is not None:
            return list(self.supervisor.restart_log)
        return list(self.sglang.restart_log) if self.sglang is not None else []

    def shutdown(self) -> None:
        """Stop the engine servers (sglang) and the router, or the diffusers engines' health checks."""
        if self.sglang is not None:
            self.sglang.shutdown()
        if self.supervisor is not None:
            self.supervisor.shutdown()

    def engine_state_dict(self, index: int = 0) -> dict[str, Any]:
        engine = self.engines[index]
        if self.use_ray_engines:
            import ray

            return ray.get(engine.transformer_state_dict.remote())
        return engine.transformer_state_dict()

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, rollout_id: int = 0) -> tuple[dict[str, float], dict[str, list[Sample]]]:
        """Generate and score every eval dataset (ODE, no trajectories): metrics and the samples by name."""
        from miles.rewards.dispatch import score_samples
        from miles.rollout.evaluation import eval_datasets, eval_groups, eval_metrics
        from miles.rollout.gold import gold_metrics

        metrics: dict[str, float] = {}
        by_name: dict[str, list[Sample]] = {}
        if rollout_hooks.eval_function(self.args) is not None:  # --eval-function-path / --rollout-function-path
            source = self.data_source if self.args.prompt_data else None
            by_name, extra = rollout_hooks.call_eval_rollout(self.args, rollout_id, source)
            for name, samples in by_name.items():
                if any(s.reward is None for s in samples):
                    asyncio.run(score_samples(self.args, [s for s in samples if s.reward is None]))
                metrics.update(eval_metrics(self.args, name, samples))
                metrics.update(gold_metrics(self.args, name, samples))
            return {**metrics, **extra}, by_name
        for dataset in eval_datasets(self.args):
            groups = eval_groups(self.args, dataset)
            requests = build_requests(self.args, groups, self.strategy, evaluation=True)
            if dataset.num_steps:
                for request in requests:
                    request.num_steps = int(dataset.num_steps)
            done = {s.index: s for s in self.run_requests(requests)}
            samples = [_merge(s, done[s.index]) for group in groups for s in group]
            asyncio.run(score_samples(self.args, samples))
            metrics.update(eval_metrics(self.args, dataset.name, samples))
            metrics.update(gold_metrics(self.args, dataset.name, samples))  # --gold-rm-type
            by_name[dataset.name] = samples
        return metrics, by_name

    # ---- phases 1 and 2 --------------------------------------------------------------------
    def run_requests(self, requests: list[GenerateRequest], score: bool = False) -> list[Sample]:
        """Spread the requests over the engines (round robin) and gather the samples. With `score` (and without
        `--group-rm`) each microgroup is scored as soon as it arrives, while the engines generate the rest
        (`miles.rollout.streaming_score`); sglang engines are reached through the miles router and score alike."""
        if rollout_hooks.generate_function(self.args) is not None:  # --custom-generate-function-path
            return rollout_hooks.run_custom_generate(self.args, requests)
        if self.sglang is not None:
            samples = self.sglang.run(requests, score=score)
            self.generation_end = self.sglang.generation_end
            return samples
        from miles.rollout.streaming_score import StreamingScorer

        shards: list[list[GenerateRequest]] = [[] for _ in self.engines]
        for i, request in enumerate(requests):
            shards[i % len(self.engines)].append(request)
        if not score or self.args.group_rm:  # nothing to score while generating
            samples = self._generate(shards, None)
            self.generation_end = time.perf_counter()
            return samples
        with StreamingScorer(self.args) as scorer:
            samples = self._generate(shards, scorer.submit)
            self.generation_end = time.perf_counter()  # the scoring of the last microgroups may go on
        return samples

    def _generate(self, shards: list[list[GenerateRequest]], on_result: Any) -> list[Sample]:
        """The diffusers engines' samples, one call per microgroup; `on_result` gets each call's samples."""
        from miles.rollout.engines.diffusers_engine import eval_batches, forward_batch_sizes

        if self.supervisor is not None:  # a dead engine's unfinished calls are re-sent
            return self.supervisor.run(shards, on_result=on_result)
        sizes = forward_batch_sizes(self.args)
        units = [(i, unit) for i, shard in enumerate(shards) if shard for unit in eval_batches(shard, *sizes)]
        if not self.use_ray_engines:
            results = []
            for i, unit in units:
                results.append(self.engines[i].generate(unit))
                if on_result is not None:
                    on_result(results[-1])
            return [sample for result in results for sample in result]
        import ray

        refs = [self.engines[i].generate.remote(unit) for i, unit in units]  # in order on each engine
        order = {ref: k for k, ref in enumerate(refs)}
        done: dict[int, list[Sample]] = {}
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            for ref in ready:
                done[order[ref]] = ray.get(ref)
                if on_result is not None:
                    on_result(done[order[ref]])
        return [sample for k in range(len(refs)) for sample in done[k]]

    def generate(self, rollout_id: int, images: bool = True) -> RolloutBatch:
        """One rollout: generate, score, filter, advantages. `images=False` (the driver's `images_travel`): the
        samples leave without their decoded images, which only the preview keeps."""
        from miles.rewards.dispatch import score_groups, score_samples
        from miles.rollout.advantages import post_process_rewards
        from miles.rollout.diversity import intra_group_diversity
        from miles.rollout.filter_hub import apply_dynamic_filter, apply_sample_filter
        from miles.rollout.reward_metrics import component_metrics

        args = self.args
        start = time.perf_counter()
        hook_metrics: dict[str, float] = {}
        if rollout_hooks.rollout_function(args) is not None:  # --rollout-function-path
            groups, hook_metrics = rollout_hooks.call_train_rollout(args, rollout_id, self.data_source)
        else:
            groups = self.data_source.get_samples(int(args.rollout_batch_size))
            if self.supervisor is not None:
                self.supervisor.inject_crash(rollout_id)  # --ci-test --use-fault-tolerance, rollout id >= 2
            if not hasattr(self, "_allowed_steps"):
                self._allowed_steps = trained_expert_steps(args, int(args.diffusion_num_steps))
            requests = build_requests(
                args, groups, self.strategy, allowed_steps=self._allowed_steps, rollout_id=rollout_id
            )
            self.generation_end = None
            by_index = {s.index: s for s in self.run_requests(requests, score=True)}
            groups = [[_merge(s, by_index[s.index]) for s in group] for group in groups]
        # generation ends when the last sample arrives; the scoring of the last microgroups may end later
        generated = self.generation_end or time.perf_counter()
        flat = [s for group in groups for s in group]
        if args.group_rm:
            asyncio.run(score_groups(args, groups))
        elif any(s.reward is None for s in flat):
            asyncio.run(score_samples(args, [s for s in flat if s.reward is None]))
        scored = time.perf_counter()

        kept, dropped = apply_dynamic_filter(args, groups)
        removed = apply_sample_filter(args, kept)
        samples = [s for group in kept for s in group]
        _, adv = post_process_rewards(args, samples) if samples else ([], [])
        all_raw = [s.scalar_reward(args.reward_key) for s in flat]
        metrics = {
            "rollout/reward/raw_mean": statistics.fmean(all_raw),
            "rollout/reward/raw_std": statistics.pstdev(all_raw) if len(all_raw) > 1 else 0.0,
            "rollout/reward/raw_max": max(all_raw),
            "rollout/reward/raw_min": min(all_raw),
            "rollout/advantage/abs_mean": statistics.fmean(abs(a) for a in adv) if adv else 0.0,
            "rollout/num_samples": float(len(samples)),
            "rollout/dropped_groups": float(sum(dropped.values())),
            "rollout/removed_samples": float(removed),
            "perf/generate_time": generated - start,
            "perf/reward_time": scored - generated,
            "perf/rollout_time": time.perf_counter() - start,
            **hook_metrics,
        }
        metrics.update(component_metrics("rollout/reward", flat))
        diversity = intra_group_diversity(groups)
        if diversity is not None:
            metrics["rollout/diversity"] = diversity
        calls = sum(s.denoiser_calls for s in flat)
        if calls:  # what the engine computed for this rollout (a shared prefix counted once)
            metrics["rollout/denoiser_calls"] = calls
            metrics["rollout/denoiser_calls_per_sample"] = calls / len(flat)
        log_probs = [lp for s in samples if s.trajectory is not None for lp in s.trajectory.log_probs.tolist()]
        if log_probs:
            metrics["rollout/log_prob_mean"] = statistics.fmean(log_probs)
        if not images:
            return without_images(rollout_id, samples, metrics)
        return RolloutBatch(rollout_id=rollout_id, samples=samples, metrics=metrics)


def _merge(planned: Sample, done: Sample) -> Sample:
    """The engine's sample, with the data source's bookkeeping kept."""
    done.index, done.group_index, done.metadata = planned.index, planned.group_index, planned.metadata
    return done


def manager_actor_class() -> Any:
    from miles.utils.actors import owned_remote

    return owned_remote(RolloutManager)
