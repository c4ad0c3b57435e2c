"""EMA copy of the trained weights."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, ENUM, FLOAT, INT, Flag

GROUP = "EMA"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f(
        "use-ema",
        BOOL,
        False,
        "Keep an EMA copy of the weights; needs --ref-mode ema or --ema-rollout-policy ema to use it.",
    ),
    _f(
        "ema-rollout-policy",
        ENUM,
        "live",
        "Which weights are pushed to the rollout engines: the live ones or the EMA copy.",
        choices=("live", "ema"),
    ),
    _f("ema-decay-init", FLOAT, 0.001, "EMA decay during the flat period.", min=0, max=1),
    _f(
        "ema-decay-ramp",
        FLOAT,
        0.001,
        "Per-step increase of the decay after the flat period (the ramp starts from zero).",
        min=0,
        max=1,
    ),
    _f("ema-decay-max", FLOAT, 0.5, "Upper bound of the EMA decay.", min=0, max=1),
    _f("ema-decay-flat-steps", INT, 0, "Steps at --ema-decay-init before the ramp starts.", min=0),
]
