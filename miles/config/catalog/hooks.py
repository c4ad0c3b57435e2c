"""Rollout customization hooks: each takes a dotted path to your function or class."""

from __future__ import annotations

from miles.config.catalog._common import flag_maker
from miles.config.flags import DOTTED, Flag

GROUP = "Rollout customization hooks"
_f = flag_maker(GROUP)

FLAGS: list[Flag] = [
    _f(
        "custom-generate-function-path",
        DOTTED,
        None,
        "Replaces the inner generate call of the diffusion rollout (default: one microgroup per request).",
    ),
    _f("dynamic-sampling-filter-path", DOTTED, None, "Per-group keep/drop filter applied after scoring."),
    _f(
        "rollout-sample-filter-path",
        DOTTED,
        None,
        "Per-sample loss mask (set sample.remove_sample); masked samples still count for advantages.",
    ),
    _f("buffer-filter-path", DOTTED, None, "Chooses which buffered samples a rollout takes (default: pop first)."),
    _f(
        "custom-convert-samples-to-train-data-path",
        DOTTED,
        None,
        "Replaces the whole conversion of samples into train data.",
    ),
    _f(
        "custom-expand-samples-to-train-pairs-path",
        DOTTED,
        None,
        "Replaces only the expansion of each sample into train pairs.",
    ),
    _f("custom-rollout-log-function-path", DOTTED, None, "Replaces the logging of train rollouts."),
    _f("custom-eval-rollout-log-function-path", DOTTED, None, "Replaces the logging of eval rollouts."),
]
