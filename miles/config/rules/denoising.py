"""The trained steps on the denoising grid (`miles.sampling.trained_steps`): one warning per problem (the preflight
counts them and `inspect-config` prints the grid they refer to); a refusal only for step flags that do not fit the
grid or the trained experts' steps at all, which the first rollout would raise."""

from __future__ import annotations

from miles.config.jobs import JobSpec
from miles.config.resolution import Resolution


def check_trained_steps(res: Resolution, job: JobSpec) -> None:
    """Warn about the trained steps' problems; refuse step flags that do not fit the grid (the first rollout would)."""
    from miles.sampling.trained_steps import grid_warnings

    try:
        lines = grid_warnings(res, job)
    except ValueError as exc:
        res.fail(f"{exc} (on the {res.show('diffusion_num_steps')} grid)")
    for line in lines:
        res.warn(line)


RULES = (check_trained_steps,)
