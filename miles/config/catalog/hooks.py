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
        "async fn(args, microgroup, sampling_params, *, evaluation=False) -> list[Sample]: replaces the engine call "
        "per microgroup request (miles.rollout.rollout_hooks).",
    ),
    _f("dynamic-sampling-filter-path", DOTTED, None, "Per-group keep/drop filter applied after scoring."),
    _f(
        "rollout-sample-filter-path",
        DOTTED,
        None,
        "Per-sample loss mask (set sample.remove_sample); masked samples still count for advantages.",
    ),
    _f(
        "buffer-filter-path",
        DOTTED,
        None,
        "Chooses which buffered groups a rollout takes (default: pop first); needs a --data-source-path that "
        "fills the buffer (add_samples).",
    ),
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
    _f(
        "custom-rollout-log-function-path",
        DOTTED,
        None,
        "fn(rollout_id, args, samples, metrics, rollout_time) -> bool; truthy skips the default rollout logging.",
    ),
    _f(
        "custom-eval-rollout-log-function-path",
        DOTTED,
        None,
        "fn(rollout_id, args, data, metrics) -> bool; truthy skips the default eval logging.",
    ),
]
