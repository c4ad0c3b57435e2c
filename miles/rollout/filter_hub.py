"""Group and sample filters applied after scoring.

Dynamic sampling filter (`--dynamic-sampling-filter-path`), per prompt group, DAPO-style:
    def filter_function(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput | bool
A dropped group is not trained on (the rollout loop may draw more prompts to replace it).
The stock filter is `miles.rollout.filter_hub.check_reward_nonzero_std`.

Sample filter (`--rollout-sample-filter-path`), on the whole batch, in place:
    def filter_function(args, data: list[list[Sample]]) -> None      # set sample.remove_sample = True
A removed sample is left out of the loss but still counts in the advantage normalization.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.core.sample import Sample
from miles.utils.hooks import load_function

DYNAMIC_FILTER_FLAG = "--dynamic-sampling-filter-path"
SAMPLE_FILTER_FLAG = "--rollout-sample-filter-path"


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group only when its rewards are not all equal (a constant group has no GRPO signal)."""
    rewards = [sample.scalar_reward(args.reward_key) for sample in samples]
    if rewards and max(rewards) > min(rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}" if rewards else "empty_group")


def _as_output(result: Any, path: str) -> DynamicFilterOutput:
    if isinstance(result, DynamicFilterOutput):
        return result
    if isinstance(result, bool):
        return DynamicFilterOutput(keep=result, reason=None if result else "filtered")
    keep = getattr(result, "keep", None)  # a look-alike output class
    if isinstance(keep, bool):
        return DynamicFilterOutput(keep=keep, reason=getattr(result, "reason", None))
    raise TypeError(
        f"{DYNAMIC_FILTER_FLAG} {path!r} returned {type(result).__name__}; expected DynamicFilterOutput or a bool"
    )


def get_dynamic_filter(args: Any) -> Callable[[list[Sample]], DynamicFilterOutput] | None:
    """The configured per-group filter as `group -> DynamicFilterOutput`, or None when no filter is set."""
    path = args.dynamic_sampling_filter_path
    if not path:
        return None
    fn = load_function(path, DYNAMIC_FILTER_FLAG)

    def apply(group: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
        return _as_output(fn(args, group, **kwargs), path)

    return apply


def apply_dynamic_filter(args: Any, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, int]]:
    """Run the dynamic sampling filter on every group: `(kept_groups, {drop reason: count})`."""
    keep_fn = get_dynamic_filter(args)
    if keep_fn is None:
        return list(groups), {}
    kept: list[list[Sample]] = []
    dropped: Counter[str] = Counter()
    for group in groups:
        out = keep_fn(group)
        if out.keep:
            kept.append(group)
        else:
            dropped[out.reason or "filtered"] += 1
    return kept, dict(dropped)


def apply_sample_filter(args: Any, groups: list[list[Sample]]) -> int:
    """Run `--rollout-sample-filter-path` in place; returns how many samples are now `remove_sample`."""
    path = args.rollout_sample_filter_path
    if path:
        load_function(path, SAMPLE_FILTER_FLAG)(args, groups)
    removed = 0
    for group in groups:
        for sample in group:
            if not isinstance(sample.remove_sample, bool):
                raise TypeError(
                    f"{SAMPLE_FILTER_FLAG} {path!r} set sample {sample.index}.remove_sample to "
                    f"{sample.remove_sample!r}; it must be a bool"
                )
            removed += sample.remove_sample
    return removed
