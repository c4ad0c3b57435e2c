"""Engine health-check and fault-tolerance rules (both rollout backends).

--rollout-health-check-interval 0 turns the periodic checks off; a check (periodic, or the probe that
finds which engine died under a failed call) needs a positive --rollout-health-check-timeout; the first
wait only delays periodic checks; and fault tolerance needs engines to restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def check_health_checks(res: Resolution, job: JobSpec) -> None:
    if res["rollout_health_check_timeout"] <= 0:
        res.fail(
            f"{res.show('rollout_health_check_timeout')}: a health check needs time to answer; give it a "
            "positive number of seconds"
        )
    if res["rollout_health_check_interval"] <= 0 and res.explicit("rollout_health_check_first_wait"):
        res.fail(
            f"{res.show('rollout_health_check_first_wait')} delays health checks that "
            f"{res.show('rollout_health_check_interval')} turns off"
        )


def check_fault_tolerance(res: Resolution, job: JobSpec) -> None:
    if not (res["use_fault_tolerance"] and res.explicit("use_fault_tolerance")):
        return
    if res["train_only"] or res["load_debug_rollout_data"] is not None:
        why = "--train-only" if res["train_only"] else "--load-debug-rollout-data"
        res.fail(
            f"{res.show('use_fault_tolerance')}: `miles {job.command}` starts no rollout engines ({why}) to restart"
        )


RULES = (check_health_checks, check_fault_tolerance)
