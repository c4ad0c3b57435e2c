"""`miles train rl`: the loop of the core concepts.

for rollout_id in range(start_rollout_id, num_rollout):
    batch = rollout_manager.generate(rollout_id)      # 1. sample, 2. score
    metrics = actor.train(rollout_id, batch.samples)  # 3. optimize
    rollout_manager.update_weights(actor weights)     # 4. sync
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.eval_schedule import evaluates, has_eval_data
from miles.io.dashboard import NullDashboard, open_dashboard
from miles.io.loggers import MetricsLogger
from miles.rollout.rollout_hooks import log_eval, log_rollout
from miles.runtime.ci_check import ci_check
from miles.runtime.output import export_at, export_due, export_final
from miles.runtime.progress import progress_bar
from miles.runtime.session import ray_job

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def train_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Trainer metrics under the reference's names (`train/...`, `perf/train_time`)."""
    out = {f"train/{k}": v for k, v in metrics.items() if k != "train_time"}
    if "train_time" in metrics:
        out["perf/train_time"] = metrics["train_time"]
    return out


def run(resolved: ResolvedJob) -> int:
    import ray

    from miles.runtime.phases import Phases
    from miles.runtime.trainer_group import TrainerGroup

    args = resolved.trainer_args["actor"]
    if args.debug_rollout_only:  # rollouts only: the rollout-only job (every rollout saved)
        from miles.runtime import rollout_only

        return rollout_only.run(resolved)
    if args.load_debug_rollout_data is not None:  # train on saved rollouts: no engines, sync or eval
        return run_from_files(resolved, args)
    with ray_job(resolved, args) as job:
        out, manager = job.out, job.manager
        num_rollout = args.num_rollout or ray.get(manager.num_rollout.remote())
        total_steps = max(1, num_rollout * int(args.num_steps_per_rollout or 1))
        group = TrainerGroup(args, "actor", total_steps, job.placement)
        job.record_placement([group])
        restored: dict[str, Any] = {}
        start = resume(args, manager, group, restored=restored)
        dash = open_dashboard(args, resolved.spec.name, resolved.recipe)
        phases = Phases(args, manager, [group], dash=dash)
        phases.start()
        guard = reward_guard_of(args, out, restored)  # --gold-rm-type / --reward-guard
        logger = MetricsLogger(args, out, resolved.spec.name, echo=lambda line: None)
        end, ended_at_eval = num_rollout, False
        with progress_bar("train rl", num_rollout - start) as advance:
            for rollout_id in range(start, num_rollout):
                metrics: dict[str, float] = {}
                if eval_due(args, rollout_id, start):
                    metrics.update(run_eval(args, manager, out, rollout_id, dash))
                    if guard is not None:
                        metrics.update(guard.after_eval(rollout_id, metrics, group, phases.trainers_awake))
                        if guard.ended:  # stop / rollback before this rollout trains: these weights were evaluated
                            end, ended_at_eval = rollout_id, True
                            logger.log(rollout_id, metrics)
                            break
                step_metrics, batch = run_iteration(args, manager, group, rollout_id, phases, dash)
                metrics.update(step_metrics)
                if guard is not None:
                    metrics.update(guard.after_rollout(metrics))
                # `batch.samples` is fetched into the driver only where something reads it (`RolloutBatch`)
                if args.save_debug_rollout_data or args.save_debug_train_data:
                    save_debug_data(args, rollout_id, batch.samples, step_metrics)
                hooked = bool(args.custom_rollout_log_function_path)
                if hooked and log_rollout(args, rollout_id, batch.samples, batch.metrics):  # the hook replaced it
                    advance(logger.log(rollout_id, {k: v for k, v in metrics.items() if k not in batch.metrics}))
                else:
                    advance(logger.log(rollout_id, metrics))
                    logger.log_images(rollout_id, *_images(args, batch.preview))
                if save_due(args, rollout_id, num_rollout) or (guard is not None and guard.ended and args.save):
                    with dash.span("save", rollout_id=rollout_id), phases.trainers_awake():
                        save(args, manager, group, rollout_id, guard)
                if export_due(args, rollout_id, num_rollout) and not (guard is not None and guard.ended):
                    with dash.span("export", rollout_id=rollout_id), phases.trainers_awake():
                        export_at(args, group, rollout_id + 1)
                if guard is not None and guard.ended:  # stop / rollback after this rollout trained
                    end = rollout_id + 1
                    break
        if evaluates(args, "rl") and start < num_rollout and not ended_at_eval:  # eval data: always after the last
            final = run_eval(args, manager, out, end, dash)
            if guard is not None:
                final.update(guard.after_eval(end, final, group, phases.trainers_awake))
            logger.log(end, final)
        if guard is not None:  # under rollback the export is the best gold reward's weights
            guard.restore_best(group, lambda: sync_weights(manager, group, end + 1), phases.trainers_awake)
        with dash.span("export"), phases.trainers_awake():
            export_final(args, group)
        logger.close()
        dash.close()
    print(f"miles: train rl finished {num_rollout - start} rollouts; metrics in {out / 'metrics.jsonl'}")
    return ci_check(args, out, job.metrics_start)


def run_from_files(resolved: ResolvedJob, args: Any) -> int:
    """`--load-debug-rollout-data TEMPLATE` (with or without --train-only): each rollout id trains on the
    rollout saved at the template filled with it (`miles replay` for a whole run); no engine starts."""
    from miles.io.rollout_file import format_rollout_path, load_rollout, subsample_rollout
    from miles.runtime.trainer_group import TrainerGroup

    template = args.load_debug_rollout_data
    num_rollout = int(args.num_rollout or 1)
    with ray_job(resolved, args, manager_class=None) as job:
        out = job.out
        total_steps = max(1, num_rollout * int(args.num_steps_per_rollout or 1))
        group = TrainerGroup(args, "actor", total_steps, job.placement)
        job.record_placement([group])
        start = resume(args, None, group)
        dash = open_dashboard(args, resolved.spec.name, resolved.recipe)
        logger = MetricsLogger(args, out, resolved.spec.name, echo=lambda line: None)
        with progress_bar("train rl (saved rollouts)", num_rollout - start) as advance:
            for rollout_id in range(start, num_rollout):
                with dash.span("load", rollout_id=rollout_id):
                    _, samples, _ = load_rollout(format_rollout_path(template, rollout_id))
                if args.load_debug_rollout_data_subsample:
                    samples = subsample_rollout(
                        samples, args.load_debug_rollout_data_subsample, group_size=args.n_samples_per_prompt
                    )
                t0 = time.perf_counter()
                with dash.span("train", rollout_id=rollout_id):
                    metrics = train_metrics(group.train(rollout_id, samples))
                metrics["perf/step_time"] = time.perf_counter() - t0
                save_debug_data(args, rollout_id, samples, metrics)
                advance(logger.log(rollout_id, metrics))
                if save_due(args, rollout_id, num_rollout):
                    save(args, None, group, rollout_id)
                if export_due(args, rollout_id, num_rollout):
                    export_at(args, group, rollout_id + 1)
        export_final(args, group)
        logger.close()
        dash.close()
    print(f"miles: train rl trained on {num_rollout - start} saved rollouts; metrics in {out / 'metrics.jsonl'}")
    return ci_check(args, out, job.metrics_start)


def save_debug_data(args: Any, rollout_id: int, samples: list[Any], metrics: dict[str, float]) -> None:
    """`--save-debug-rollout-data` (the rollout as generated and scored, a file `miles replay` reads) and
    `--save-debug-train-data` (what the trainer trained on, with the step's train metrics), per rollout id."""
    from miles.io.rollout_file import format_rollout_path, save_rollout
    from miles.models.model_record import model_record_of

    if not (args.save_debug_rollout_data or args.save_debug_train_data):
        return
    model = model_record_of(args)  # the family and denoiser shapes, checked by `miles replay`
    if args.save_debug_rollout_data:
        path = format_rollout_path(args.save_debug_rollout_data, rollout_id)
        save_rollout(path, rollout_id, samples, model=model)
    if args.save_debug_train_data:
        train = {k: float(v) for k, v in metrics.items() if k.startswith("train/")}
        path = format_rollout_path(args.save_debug_train_data, rollout_id)
        save_rollout(path, rollout_id, samples, {"metrics": train}, model=model)


def eval_due(args: Any, rollout_id: int, start: int) -> bool:
    if not has_eval_data(args) or not args.eval_interval:
        return False
    if rollout_id == start == 0:
        return not args.skip_eval_before_train
    return rollout_id % args.eval_interval == 0


def run_eval(args: Any, manager: Any, out: Path, rollout_id: int, dash: Any = None) -> dict[str, float]:
    import ray

    from miles.runtime.eval_job import save_eval_grids

    with (dash or NullDashboard()).span("eval", rollout_id=rollout_id):
        metrics, by_name = ray.get(manager.evaluate.remote(rollout_id))
    if log_eval(args, rollout_id, by_name, metrics):  # --custom-eval-rollout-log-function-path took over
        return {}
    save_eval_grids(args, out, by_name, tag=f"_{rollout_id}")
    return metrics


def save_due(args: Any, rollout_id: int, num_rollout: int) -> bool:
    if not args.save:
        return False
    last = rollout_id == num_rollout - 1
    return last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)


def save(args: Any, manager: Any, group: Any, rollout_id: int, guard: Any = None) -> None:
    import ray

    state = ray.get(manager.data_source_state.remote()) if manager is not None else None
    extra: dict[str, Any] = {"rollout_id": rollout_id, "data_source": state}
    if guard is not None:
        extra["reward_guard"] = guard.guard.state_dict()
    group.call("save_checkpoint", args.save, rollout_id, extra)


def reward_guard_of(args: Any, out: Path, restored: dict[str, Any]) -> Any:
    """The job's `GuardRunner` (None without --gold-rm-type and --reward-guard), its state resumed from `--load`."""
    from miles.runtime.reward_guard import GuardRunner, RewardGuard

    guard = RewardGuard.from_args(args)
    if guard is None:
        return None
    guard.load_state_dict(restored.get("reward_guard"))
    return GuardRunner(guard, out)


def resume(
    args: Any, manager: Any, group: Any, ckpt_step: int | None = None, restored: dict[str, Any] | None = None
) -> int:
    """Restore `--load` (trainer state, data source) and sync the engines; the first rollout id to run.
    `ckpt_step`: the step to load (default --ckpt-step, else the newest complete checkpoint); `restored`, when
    given, receives the checkpoint's `extra` (e.g. the reward guard's state)."""
    import ray

    start = 0
    if args.load:
        step = args.ckpt_step if ckpt_step is None else ckpt_step
        extra = group.call("load_checkpoint", args.load, step)[0]
        if restored is not None:
            restored.update(extra)
        start = int(extra["rollout_id"]) + 1
        if manager is not None:  # no engines (training on saved rollouts): nothing to restore or sync
            if extra.get("data_source"):
                ray.get(manager.load_data_source_state.remote(extra["data_source"]))
            sync_weights(manager, group, start)
    if args.start_rollout_id is not None:
        start = int(args.start_rollout_id)
    return start


def sync_weights(manager: Any, group: Any, version: int) -> None:
    """Phase 4: every trainer rank joins the gather (only the LoRA tensors under --lora-ipc-weight-sync).
    Under --colocate each engine gets them by handle from the trainer rank on its device, directly
    (`TrainerGroup.sync_in_place`: CUDA IPC, shared memory on CPU; `sync/bytes_by_handle`); otherwise rank
    0's copy goes to the engines through Ray's object store."""
    import ray

    engines = ray.get(manager.in_place_engines.remote())
    if engines:
        ray.get(manager.in_place_synced.remote(version, group.sync_in_place(engines, version)))
    else:
        ray.get(manager.update_weights.remote(group.weights_for_sync(), version))


def _images(args: Any, samples: list[Any], limit: int = 64) -> tuple[list[Any], list[str]]:
    shown = samples[:limit]
    return [s.image for s in shown], [f"{s.prompt} | r={s.scalar_reward(args.reward_key):.3f}" for s in shown]


def run_iteration(
    args: Any, manager: Any, group: Any, rollout_id: int, phases: Any = None, dash: Any = None
) -> tuple[dict[str, float], Any]:
    """Generate, train, sync; `phases` (`miles.runtime.phases.Phases`) moves trainer and engine memory
    between the phases under --offload-train / --offload-rollout; `dash` (`miles.io.dashboard`) records
    each phase as a span."""
    import ray

    from miles.rollout.rollout_batch import images_travel
    from miles.runtime.phases import Phases

    phases = phases or Phases.disabled()
    dash = dash or NullDashboard()
    t0 = time.perf_counter()
    with dash.span(f"rollout {rollout_id}", "iteration", track="iterations", rollout_id=rollout_id):
        with dash.span("rollout") as span:
            batch = ray.get(manager.generate.remote(rollout_id, images_travel(args)))
        if dash.enabled:
            dash.rollout(rollout_id, span.start, batch.metrics, batch.samples)
        metrics = dict(batch.metrics)
        phases.to_train()
        with dash.span("train"):
            metrics.update(train_metrics(group.train(rollout_id, batch.trainer_input())))
        phases.to_sync()
        if not args.debug_skip_optimizer_step:
            t1 = time.perf_counter()
            with dash.span("sync"):
                sync_weights(manager, group, rollout_id + 1)
            metrics["perf/sync_time"] = time.perf_counter() - t1
            metrics.update(ray.get(manager.sync_metrics.remote()))
        phases.to_rollout()
        metrics.update(phases.take_metrics())
        metrics["perf/step_time"] = time.perf_counter() - t0
    return metrics, batch
