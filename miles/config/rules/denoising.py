"""The trained steps on the denoising grid (`miles.rollout.trained_steps`): one warning per problem, never a
refusal (the grid is computed from configs miles may not hold for every checkpoint; a step strategy is the user's
choice), so the preflight counts them and `inspect-config` prints the grid they refer to."""

from __future__ import annotations

from miles.config.jobs import JobSpec
from miles.config.resolution import Resolution


def check_trained_steps(res: Resolution, job: JobSpec) -> None:
    from miles.rollout.trained_steps import grid_warnings

    for line in grid_warnings(res, job.name):
        res.warn(line)


RULES = (check_trained_steps,)
