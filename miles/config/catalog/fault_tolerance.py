"""Engine health checks and restarts."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, FLOAT, Flag

GROUP = "Fault tolerance"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("use-fault-tolerance", BOOL, False, "Health-check the engines and restart dead ones during rollout."),
    _f(
        "rollout-health-check-interval",
        FLOAT,
        30.0,
        "Seconds between engine health checks; raise it for video models.",
        min=0,
    ),
    _f("rollout-health-check-timeout", FLOAT, 30.0, "Seconds before a health check counts as failed.", min=0),
    _f(
        "rollout-health-check-first-wait",
        FLOAT,
        0.0,
        "Grace period in seconds before the first health check (compilation, init).",
        min=0,
    ),
]
