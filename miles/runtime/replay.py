"""`miles replay ROLLOUT.pt`: train on a saved rollout with no engines started.

The rollout file (written by `rollout-only`, `train rl`, or `--save-debug-rollout-data`) holds the
samples with their trajectories, log-probs and advantages: all a train step needs. With
`--debug-skip-optimizer-step` the step only recomputes and reports (e.g. train/log_prob_mean_abs_diff).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.io.loggers import MetricsLogger
from miles.io.rollout_file import load_rollout, subsample_rollout
from miles.runtime.session import ray_job
from miles.runtime.train_rl import train_metrics

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def run(resolved: ResolvedJob) -> int:

    from miles.runtime.trainer_group import TrainerGroup

    args = resolved.trainer_args["actor"]
    rollout_id, samples, _ = load_rollout(args.load_debug_rollout_data)
    if args.load_debug_rollout_data_subsample:
        samples = subsample_rollout(
            samples, args.load_debug_rollout_data_subsample, group_size=args.n_samples_per_prompt
        )
    rid = rollout_id if isinstance(rollout_id, int) else 0
    with ray_job(resolved, args, manager_class=None) as job:
        out = job.out
        steps = max(1, -(-len(samples) // int(args.global_batch_size or len(samples))))
        group = TrainerGroup(args, "actor", steps, job.placement)
        job.record_placement([group])
        metrics = train_metrics(group.train(rid, samples))
    metrics["replay/num_samples"] = float(len(samples))
    with MetricsLogger(args, out, resolved.spec.name) as logger:
        logger.log(rid, metrics)
    return 0
