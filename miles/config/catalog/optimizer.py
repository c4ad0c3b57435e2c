"""Optimizer, learning-rate schedule and seed."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, ENUM, FLOAT, INT, Flag

GROUP = "Optimizer and schedule"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("optimizer", ENUM, "adam", "Optimizer; adam means AdamW and is the only value.", choices=("adam",)),
    _f("lr", FLOAT, 1e-6, "Peak learning rate.", min=0),
    _f("adam-beta1", FLOAT, 0.9, "AdamW beta1.", min=0, max=1),
    _f("adam-beta2", FLOAT, 0.999, "AdamW beta2 (0.999 as in flow_grpo, not the LLM-side 0.95).", min=0, max=1),
    _f("adam-eps", FLOAT, 1e-8, "AdamW epsilon.", min=0),
    _f("weight-decay", FLOAT, 0.0, "AdamW decoupled weight decay.", min=0),
    _f("clip-grad", FLOAT, 1.0, "Gradient-norm clipping threshold.", min=0),
    _f(
        "lr-decay-style",
        ENUM,
        "constant",
        "Shape of the learning-rate decay after warmup.",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    ),
    _f("min-lr", FLOAT, 0.0, "Floor of the decayed learning rate.", min=0),
    _f("lr-warmup-init", FLOAT, 0.0, "Learning rate at the start of warmup.", min=0),
    _f("lr-warmup-iters", INT, 0, "Warmup length in optimizer steps.", min=0),
    _f(
        "lr-warmup-fraction",
        FLOAT,
        None,
        "Warmup length as a fraction of the decay steps (instead of --lr-warmup-iters).",
        min=0,
        max=1,
    ),
    _f("lr-decay-iters", INT, None, "Steps over which the learning rate decays; default: the whole run.", min=0),
    _f("lr-wsd-decay-iters", INT, None, "Length of the final decay phase of the WSD schedule.", min=0),
    _f(
        "lr-wsd-decay-style",
        ENUM,
        None,
        "Shape of the final decay phase of the WSD schedule.",
        choices=("linear", "cosine", "exponential", "minus_sqrt"),
    ),
    _f(
        "use-checkpoint-lr-scheduler",
        BOOL,
        True,
        "On resume, take the scheduler settings from the checkpoint.",
    ),
    _f(
        "override-lr-scheduler",
        BOOL,
        False,
        "On resume, ignore the checkpoint's scheduler settings and use the command line's.",
    ),
    _f("seed", INT, 1234, "Random seed of the trainer.", min=0, max=2**32 - 1),
]
