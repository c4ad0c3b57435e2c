"""Parse-time rules over the resolved args, shared by every job (torch-free).

Each rule is a function `rule(res, job)` that derives values or raises `ConfigError` with one line
naming the flags, their values and where they came from. They run in the order listed here.
"""

from __future__ import annotations

from miles.config.rules import (
    algorithm,
    batch,
    data,
    denoising,
    engines,
    fault_tolerance,
    hooks,
    inputs,
    misc,
    optimizer,
    reward_guard,
    topology,
    training_backend,
)

SHARED_RULES = (
    *inputs.RULES,
    *topology.RULES,
    *training_backend.RULES,
    *optimizer.RULES,
    *batch.RULES,
    *algorithm.RULES,
    *data.RULES,
    *reward_guard.RULES,
    *misc.RULES,
    *engines.RULES,
    *fault_tolerance.RULES,
    *hooks.RULES,
    *denoising.RULES,
    topology.check_placement,
)
