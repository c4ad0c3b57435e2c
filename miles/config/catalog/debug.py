"""Debugging: isolate rollout or training, dump and replay data."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import BOOL, FLOAT, PATH, Flag

GROUP = "Debugging"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f("debug-rollout-only", BOOL, False, "Run rollouts only, with no training."),
    _f(
        "train-only",
        BOOL,
        False,
        "Train without engines, weight sync or eval (--debug-train-only is a legacy alias).",
        aliases=("debug-train-only",),
    ),
    _f(
        "debug-skip-optimizer-step",
        BOOL,
        False,
        "Skip backward and the optimizer step so weights never change (alignment probes).",
    ),
    _f(
        "save-debug-rollout-data",
        PATH,
        None,
        "Path template, formatted with rollout_id, to save each rollout to.",
        metavar="TEMPLATE",
    ),
    _f(
        "load-debug-rollout-data",
        PATH,
        None,
        "Path template, formatted with rollout_id, to replay rollouts from; no engines are started.",
        metavar="TEMPLATE",
    ),
    _f(
        "load-debug-rollout-data-subsample",
        FLOAT,
        None,
        "Fraction of each replayed rollout to keep.",
        min=0,
        max=1,
    ),
    _f(
        "save-debug-train-data",
        PATH,
        None,
        "Path template, formatted with rollout_id, to save each step's train data to.",
        metavar="TEMPLATE",
    ),
    _f("dump-details", PATH, None, "Directory; sets all debug dump paths for post-hoc analysis.", metavar="DIR"),
    _f(
        "diffusion-debug-mode",
        BOOL,
        False,
        "Have the engine return per-step debug tensors, enabling the model_output_*_abs_diff metrics.",
    ),
]
