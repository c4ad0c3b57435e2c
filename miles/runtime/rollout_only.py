"""`miles rollout-only`: sample and score rollouts with no training, and save everything.

Per rollout: `rollout_{id}.pt` in the output dir (and at `--save-debug-rollout-data` when set),
`images/rollout_{id}.png` (a grid labelled with prompt and reward) and a line in `metrics.jsonl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.io.dashboard import open_dashboard
from miles.io.loggers import MetricsLogger
from miles.io.rollout_file import format_rollout_path, save_rollout
from miles.models.model_record import model_record_of
from miles.rollout.rollout_hooks import log_rollout
from miles.runtime.progress import progress_bar
from miles.runtime.session import ray_job

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def run(resolved: ResolvedJob) -> int:
    import ray

    args = resolved.args
    with ray_job(resolved, args) as job:
        out, manager = job.out, job.manager
        job.record_placement()
        num_rollout = args.num_rollout or ray.get(manager.num_rollout.remote())
        start = args.start_rollout_id or 0
        dash = open_dashboard(args, resolved.spec.name, resolved.recipe)
        logger = MetricsLogger(args, out, resolved.spec.name, echo=lambda line: None)
        model = model_record_of(args)  # the family and denoiser shapes, checked by `miles replay`
        with progress_bar("rollout", num_rollout - start) as advance:
            for rollout_id in range(start, num_rollout):
                with dash.span("rollout", rollout_id=rollout_id) as span:
                    batch = ray.get(manager.generate.remote(rollout_id))
                dash.rollout(rollout_id, span.start, batch.metrics, batch.samples)
                with dash.span("save", rollout_id=rollout_id):
                    save_rollout(out / f"rollout_{rollout_id}.pt", rollout_id, batch.samples, model=model)
                    if args.save_debug_rollout_data:
                        template = format_rollout_path(args.save_debug_rollout_data, rollout_id)
                        save_rollout(template, rollout_id, batch.samples, model=model)
                if log_rollout(args, rollout_id, batch.samples, batch.metrics):  # the hook replaced the logging
                    advance("")
                    continue
                labels = [f"{s.prompt} | r={s.scalar_reward(args.reward_key):.3f}" for s in batch.samples]
                logger.log_images(rollout_id, [s.image for s in batch.samples], labels)
                advance(logger.log(rollout_id, batch.metrics))
        logger.close()
        dash.close()
    print(f"miles: wrote {num_rollout - start} rollouts to {out}")
    return 0
