"""The preflight's reward check: a job that scores through a reward service (`--rm-type remote_rm`) reaches it,
and it speaks this protocol version and serves the reward, before anything starts. Under --use-fault-tolerance
a service that is not up yet is a warning (the job waits for it, up to --rm-fault-wait, when it first scores)."""

from __future__ import annotations

import copy
import sys
from typing import TYPE_CHECKING

from miles.core.errors import ConfigError
from miles.rewards import reward_names

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def check_remote_reward(resolved: ResolvedJob) -> list[str]:
    args = resolved.args
    if args.custom_rm_path or "remote_rm" not in reward_names(args) or args.train_only:
        return []
    from miles.rewards.dispatch import RewardError
    from miles.rewards.scorers.remote import check_remote

    probe = args
    if args.use_fault_tolerance:  # one quick look, no retry and no wait: the job itself waits for the service
        probe = copy.copy(args)
        probe.use_fault_tolerance, probe.rm_retries = False, 0
    try:
        check_remote(probe)
    except ConfigError as exc:
        return [f"--rm-url {args.rm_url}: {exc}"]
    except RewardError as exc:
        if args.use_fault_tolerance:
            print(f"miles: warning: {exc} (--use-fault-tolerance: the job waits for it)", file=sys.stderr)
            return []
        return [str(exc)]
    return []
