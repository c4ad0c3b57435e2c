"""The batch-knob invariant and the micro-batch rules.

    rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout

rollout_batch_size is required where the job generates; of the right-hand pair, set one and the
other is derived (neither set: one optimizer step per rollout). global_batch_size must divide by
dp_size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution
from miles.config.rules.topology import dp_size

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec

INVARIANT = "rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout"


def check_batch_invariant(res: Resolution, job: JobSpec) -> None:
    if not (job.generates or job.trains):
        return
    rbs, n = res["rollout_batch_size"], res["n_samples_per_prompt"]
    gbs, steps = res["global_batch_size"], res["num_steps_per_rollout"]
    if rbs is None:
        if job.generates:
            res.fail(f"--rollout-batch-size is required by `miles {job.command}` (prompts per rollout; no default)")
        if job.trains_on_dataset and gbs is not None:
            # Train-only SFT: the dataset rows per iteration follow from the optimizer side.
            rows = gbs * (steps or 1)
            if rows % n:
                res.fail(
                    f"{res.show('global_batch_size')} x steps = {rows} must divide by "
                    f"{res.show('n_samples_per_prompt')}"
                )
            rbs = rows // n
            res.derive("rollout_batch_size", rbs)
        elif job.trains_on_dataset:
            res.fail(
                f"`miles {job.command}` needs --rollout-batch-size or --global-batch-size (dataset rows per step)"
            )
        else:
            return  # replay: the rollout file decides
    samples = rbs * n
    where = f"{res.show('rollout_batch_size')} x {res.show('n_samples_per_prompt')} = {samples}"
    if gbs is not None and steps is not None:
        if gbs * steps != samples:
            res.fail(
                f"batch-knob invariant {INVARIANT} violated: {where}, but "
                f"{res.show('global_batch_size')} x {res.show('num_steps_per_rollout')} = {gbs * steps}"
            )
    elif gbs is not None or steps is not None:  # one knob given: the other is the samples divided by it
        knobs = ("global_batch_size", "num_steps_per_rollout")
        given, derived = knobs if gbs is not None else knobs[::-1]
        divisor = res[given]
        if samples % divisor:
            res.fail(
                f"batch-knob invariant {INVARIANT} violated: {where} samples per rollout "
                f"is not divisible by {res.show(given)}"
            )
        res.derive(derived, samples // divisor)
    else:
        res.derive("num_steps_per_rollout", 1)
        res.derive("global_batch_size", samples)


def check_dp_divisibility(res: Resolution, job: JobSpec) -> None:
    gbs = res["global_batch_size"]
    if gbs is None or not job.trains:
        return
    dp = dp_size(res)
    if gbs % dp:
        res.fail(
            f"{res.show('global_batch_size')} must divide by dp_size {dp} "
            f"(= {res.show('actor_num_nodes')} x {res.show('actor_num_gpus_per_node')} "
            f"/ {res.show('sequence_parallel_size')})"
        )


def check_over_sampling(res: Resolution, job: JobSpec) -> None:
    osb = res["over_sampling_batch_size"]
    if osb is not None and osb != res["rollout_batch_size"]:
        res.fail(f"{res.show('over_sampling_batch_size')} must equal {res.show('rollout_batch_size')} today")


def check_micro_batch(res: Resolution, job: JobSpec) -> None:
    s, t = res["micro_batch_size_sample"], res["micro_batch_size_tstep"]
    if (s is None) != (t is None):
        res.fail(
            f"{res.show('micro_batch_size_sample')} and {res.show('micro_batch_size_tstep')} "
            "must be set together (the 2D tile is samples x timesteps)"
        )
    if s is not None:
        if res.explicit("micro_batch_size") and res["micro_batch_size"] != s * t:
            res.warn(
                f"{res.show('micro_batch_size')} is replaced by the 2D tile "
                f"--micro-batch-size-sample {s} x --micro-batch-size-tstep {t} = {s * t}"
            )
        res.derive("micro_batch_size", s * t)
    elif res.explicit("diffusion_train_iter_order"):
        res.warn(f"{res.show('diffusion_train_iter_order')} only matters with the 2D micro-batch tile; ignored")


def check_run_length(res: Resolution, job: JobSpec) -> None:
    if res["num_rollout"] is not None and res["num_epoch"] is not None:
        res.warn(f"{res.show('num_epoch')} is ignored because {res.show('num_rollout')} is set")


RULES = (check_batch_invariant, check_dp_divisibility, check_over_sampling, check_micro_batch, check_run_length)
