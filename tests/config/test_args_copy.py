"""`copy.copy(args)` gives args whose values can be set without touching the original's (the SFT evaluator and the
preflight's look at a reward service set values on a copy)."""

from __future__ import annotations

import copy

from miles.config.resolution import schema_args


def test_a_copy_is_set_apart_from_its_original() -> None:
    args = schema_args(rm_retries=3, rollout_backend="auto")
    probe = copy.copy(args)
    probe.rm_retries, probe.rollout_backend = 0, "diffusers"
    assert (args.rm_retries, args.rollout_backend) == (3, "auto")
    assert (probe.rm_retries, probe.rollout_backend) == (0, "diffusers")
    assert probe.job == args.job and probe.custom is args.custom  # the values themselves are shared
