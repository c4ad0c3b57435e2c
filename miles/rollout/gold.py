"""The held-out gold reward (`--gold-rm-type`): a second reward scored on the evaluation samples beside the
training proxy, so that a policy that raises the proxy while the gold falls (reward hacking) shows in the metrics
(`eval/<name>/gold_reward_mean`) and can be acted on (`--reward-guard`, `miles.runtime.reward_guard`).

`--gold-rm-type` is a built-in reward type (`digit`, `ocr`, `pickscore`, ...) or the dotted path of a reward
function with `--custom-rm-path`'s contract. It scores copies of the samples: their proxy rewards stay, and a
sample's `metadata.rm_type` (which picks its proxy) is ignored for the gold.
"""

from __future__ import annotations

import asyncio
import copy
import statistics
from typing import Any

from miles.core.sample import Sample


class GoldArgs:
    """`args` as the reward dispatch sees them for the gold reward: the gold type, or the gold function as the
    custom reward, and every other setting (checkpoints, model paths) the job's."""

    def __init__(self, args: Any) -> None:
        self._args = args
        gold = str(args.gold_rm_type)
        self.custom_rm_path = gold if "." in gold else None
        self.rm_type = None if "." in gold else [gold]
        self.reward_weights = None
        self.reward_key = args.gold_reward_key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def gold_rewards(args: Any, samples: list[Sample]) -> list[float]:
    """The gold reward of each sample (scalar; a dict reward is read at `--gold-reward-key`)."""
    from miles.rewards.dispatch import batched_async_rm

    view = GoldArgs(args)
    copies = []
    for sample in samples:
        twin = copy.copy(sample)
        twin.metadata = {k: v for k, v in sample.metadata.items() if k != "rm_type"}
        twin.reward = None
        copies.append(twin)
    rewards = asyncio.run(batched_async_rm(view, copies))
    for twin, reward in zip(copies, rewards, strict=True):
        twin.reward = reward
    return [twin.scalar_reward(view.reward_key) for twin in copies]


def gold_metrics(args: Any, name: str, samples: list[Sample]) -> dict[str, float]:
    """`eval/<name>/gold_reward_mean` and `_std` of one evaluation set ({} without `--gold-rm-type`)."""
    if not args.gold_rm_type or not samples:
        return {}
    values = gold_rewards(args, samples)
    return {
        f"eval/{name}/gold_reward_mean": statistics.fmean(values),
        f"eval/{name}/gold_reward_std": statistics.pstdev(values) if len(values) > 1 else 0.0,
    }
