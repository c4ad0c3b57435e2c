"""`miles train dmd2`: distill a many-step teacher into a few-step student (DMD2, algorithms.md A).

Two trainer groups on the same trainer class, each from its own trainer args, colocated on the same
GPUs (the placement plan gives each half of the trainer share), run in order every iteration::

    for it in range(start, num_rollout):
        k = stop_step(seed, it)                                   # backward simulation, same on every rank
        batch = manager.generate_dmd2(it, k)                      # the student's inputs x_{t_k} and its x0
        gen = is_generator_step(it, --dmd2-critic-update-ratio)  # TTUR: the critic steps every iteration
        critic_metrics, external = critic.train(it, batch, gen)   # scores first, then its step
        if gen:
            actor.train(it, batch, external)                 # the distribution-matching step
            manager.update_weights(actor weights)                 # sync the student to the engines

At the end (with eval data): the student's n-step samples and the teacher's at 20 and n steps on the
eval datasets (`eval/student_<n>step/*`, `eval/teacher_20step/*`, `eval/teacher_<n>step/*`), a
side-by-side grid `<output-dir>/dmd2_grid.png` (teacher 20 steps | teacher n steps | student, same
seeds), and the student exported to `<output-dir>/checkpoint`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config.eval_schedule import evaluates
from miles.core.errors import ConfigError
from miles.io.loggers import MetricsLogger
from miles.runtime.ci_check import ci_check
from miles.runtime.output import export_at, export_due, export_final
from miles.runtime.phases import Phases
from miles.runtime.progress import progress_bar
from miles.runtime.session import ray_job
from miles.runtime.train_rl import save_due, sync_weights, train_metrics

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

GRID_ROWS = 10
TEACHER_STEPS = 20


def generator_iterations(num_rollout: int, ratio: int) -> int:
    """How many of `num_rollout` iterations step the student (TTUR: iterations 0, ratio, 2 ratio, ...)."""
    from miles.algorithms.dmd2 import is_generator_step

    return sum(is_generator_step(i, ratio) for i in range(num_rollout))


def check_gan_data(args: Any) -> None:
    """The GAN head's real side is the prompt data's images: its rows need an 'image' field."""
    if float(args.dmd2_gan_loss_weight) <= 0:
        return
    from miles.core.inputs import input_path
    from miles.rollout.data_source import iter_jsonl_objects

    spec = args.prompt_data
    path = input_path(args, spec)
    for where, _, row in iter_jsonl_objects(path, "prompt data"):
        if "image" not in row:
            raise ConfigError(
                f"--dmd2-gan-loss-weight {args.dmd2_gan_loss_weight} needs real images: {where} has no 'image' "
                f"field; give --prompt-data rows with images (e.g. digits:sft) or set --dmd2-gan-loss-weight 0"
            )
        return


def critic_metrics(metrics: dict[str, float]) -> dict[str, float]:
    out = {f"critic/{k}": v for k, v in metrics.items() if k not in ("train_time", "score_time")}
    out["perf/critic_time"] = metrics.get("train_time", 0.0)
    out["perf/score_time"] = metrics.get("score_time", 0.0)
    return out


def run(resolved: ResolvedJob) -> int:
    import ray

    from miles.rollout.dmd2.manager import manager_actor_class
    from miles.runtime.trainer_group import TrainerGroup

    args = resolved.trainer_args["actor"]
    critic_args = resolved.trainer_args["critic"]
    check_gan_data(args)
    with ray_job(resolved, args, manager_actor_class) as job:
        out, manager = job.out, job.manager
        num_rollout = int(args.num_rollout or ray.get(manager.num_rollout.remote()))
        ratio = int(args.dmd2_critic_update_ratio)
        critic = TrainerGroup(critic_args, "critic", num_rollout, job.placement)
        actor = TrainerGroup(args, "actor", generator_iterations(num_rollout, ratio), job.placement)
        job.record_placement([critic, actor])
        start = resume(args, manager, critic, actor)
        phases = Phases(args, manager, [critic, actor])
        phases.start()
        logger = MetricsLogger(args, out, resolved.spec.name, echo=lambda line: None)
        every = max(1, (num_rollout - start) // 20)
        with progress_bar("train dmd2", num_rollout - start) as advance:
            for it in range(start, num_rollout):
                metrics = run_iteration(args, manager, critic, actor, it, phases)
                if evaluates(args, "dmd2") and args.eval_interval and it > 0 and it % args.eval_interval == 0:
                    metrics.update(ray.get(manager.evaluate_student.remote())[0])
                line = logger.log(it, metrics)
                advance(line if (it - start) % every == 0 or it == num_rollout - 1 else "")
                if save_due(args, it, num_rollout):
                    with phases.trainers_awake():
                        save(args, manager, critic, actor, it)
                if export_due(args, it, num_rollout):  # the student's weights
                    with phases.trainers_awake():
                        export_at(args, actor, it + 1, unit="iter")
        if evaluates(args, "dmd2") and start < num_rollout:
            final = final_eval(args, manager, out)
            logger.log(num_rollout, final)
            for key, value in sorted(final.items()):
                if key.endswith(("/accuracy", "/fd")):
                    print(f"{key} = {value:.4f}")
        with phases.trainers_awake():
            export_final(args, actor, "student")
        logger.close()
    print(f"miles: train dmd2 finished {num_rollout - start} iterations; metrics in {out / 'metrics.jsonl'}")
    return ci_check(args, out, job.metrics_start)


def run_iteration(args: Any, manager: Any, critic: Any, actor: Any, it: int, phases: Any = None) -> dict[str, float]:
    """One DMD2 iteration: student rollout, critic group (external data, then its step), student step, sync.
    `phases` moves trainer and engine memory between the phases under --offload-train / --offload-rollout."""
    import ray

    from miles.algorithms.dmd2 import is_generator_step
    from miles.rollout.dmd2.sampler import stop_step

    phases = phases or Phases.disabled()
    t0 = time.perf_counter()
    n = len(args.dmd2_student_timesteps)
    k = stop_step(args.seed, it, n, bool(args.dmd2_backward_simulation))
    batch = ray.get(manager.generate_dmd2.remote(it, k))
    metrics = dict(batch.metrics)
    samples = ray.put(batch.samples)
    gen = is_generator_step(it, int(args.dmd2_critic_update_ratio))
    phases.to_train()
    results = critic.call("train", it, samples, gen)
    metrics.update(critic_metrics(results[0][0]))
    if gen:
        external: dict[int, Any] = {}
        for _, part in results:
            external.update(part or {})
        metrics.update(train_metrics(actor.call("train", it, samples, ray.put(external))[0]))
    phases.to_sync()
    if gen and not args.debug_skip_optimizer_step:
        t1 = time.perf_counter()
        sync_weights(manager, actor, it + 1)  # only the LoRA tensors under --lora-ipc-weight-sync
        metrics["perf/sync_time"] = time.perf_counter() - t1
    phases.to_rollout()
    metrics.update(phases.take_metrics())
    metrics["perf/step_time"] = time.perf_counter() - t0
    return metrics


def final_eval(args: Any, manager: Any, out: Path) -> dict[str, float]:
    """Student n steps, teacher 20 and n steps on the eval datasets; the side-by-side grid."""
    import ray

    n = len(args.dmd2_student_timesteps)
    start = time.perf_counter()
    student, student_samples = ray.get(manager.evaluate_student.remote())
    teacher, teacher_samples = ray.get(manager.evaluate_teacher.remote(sorted({TEACHER_STEPS, n}, reverse=True)))
    metrics = {**student, **teacher, "perf/eval_time": time.perf_counter() - start}
    by_name = {**student_samples, **teacher_samples}
    columns = [f"teacher_{TEACHER_STEPS}step", f"teacher_{n}step", f"student_{n}step"]
    for prefix in sorted({name[: -len(columns[-1])] for name in student_samples}):
        save_side_by_side(out / f"{prefix}dmd2_grid.png", [by_name[prefix + c] for c in columns], columns)
    return metrics


def save_side_by_side(path: Path, variants: list[list[Any]], titles: list[str], rows: int = GRID_ROWS) -> Path:
    """One row per prompt (the first `rows`, preferring distinct labels), one column per variant."""
    from miles.io.images import save_grid

    picked: list[int] = []
    seen: set[Any] = set()
    for i, sample in enumerate(variants[0]):
        label = sample.metadata.get("label", sample.prompt)
        if label not in seen:
            seen.add(label)
            picked.append(i)
        if len(picked) == rows:
            break
    images, labels = [], []
    for i in picked:
        for title, samples in zip(titles, variants, strict=True):
            images.append(samples[i].image)
            labels.append(f"{title} | {samples[i].prompt}")
    return save_grid(path, images, labels, columns=len(variants))


def save(args: Any, manager: Any, critic: Any, actor: Any, it: int) -> None:
    import ray

    extra = {"rollout_id": it, "data_source": ray.get(manager.data_source_state.remote())}
    critic.call("save_checkpoint", critic_save_dir(args), it, extra)
    actor.call("save_checkpoint", args.save, it, extra)


def critic_save_dir(args: Any) -> str:
    return f"{args.save.rstrip('/')}/critic"


def resume(args: Any, manager: Any, critic: Any, actor: Any) -> int:
    """Restore `--load` as `train rl` does (student, data source, engine sync) and the critic from `<load>/critic`."""
    from miles.runtime.train_rl import resume as resume_actor

    if not args.load:
        return resume_actor(args, manager, actor)
    from miles.training.checkpoint_index import common_step

    critic_dir = f"{args.load.rstrip('/')}/critic"
    step = common_step([args.load, critic_dir], args.ckpt_step)  # both trainers resume from one step
    critic.call("load_checkpoint", critic_dir, step)
    return resume_actor(args, manager, actor, ckpt_step=step)
