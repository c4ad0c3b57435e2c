"""The held-out gold reward (`--gold-rm-type`, `--gold-reward-key`) on evaluation samples (fast, in process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rollout.gold import gold_metrics, gold_rewards


def samples(n: int = 4, rm_type: str | None = "jpeg_compressibility") -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    meta = {"label": 3} if rm_type is None else {"label": 3, "rm_type": rm_type}
    out = []
    for i in range(n):
        image = torch.rand(3, 32, 32, generator=g) * (i + 1) / n  # images of different detail
        out.append(Sample(index=i, group_index=0, prompt="p", metadata=dict(meta), image=image, reward=0.5))
    return out


def gold_fn(args, samples):  # --gold-rm-type test_gold_reward.gold_fn
    return [{"gold": float(s.index), "other": -1.0} for s in samples]


def test_the_gold_reward_scores_copies_with_another_type() -> None:
    batch = samples()
    args = schema_args("rl", gold_rm_type="jpeg_incompressibility", rm_type="digit")
    values = gold_rewards(args, batch)
    clean = samples(rm_type=None)  # the same images without the proxy's metadata.rm_type
    expected = asyncio.run(batched_async_rm(schema_args("rl", rm_type="jpeg_incompressibility"), clean))
    assert values == pytest.approx(expected) and len(set(values)) == 4
    assert all(s.reward == 0.5 and s.metadata["rm_type"] == "jpeg_compressibility" for s in batch)  # untouched
    metrics = gold_metrics(args, "digits", batch)
    assert metrics["eval/digits/gold_reward_mean"] == pytest.approx(sum(expected) / 4)
    assert gold_metrics(schema_args("rl"), "digits", batch) == {}  # no --gold-rm-type, no gold


def test_a_dict_gold_reward_is_read_at_its_key() -> None:
    args = schema_args("rl", gold_rm_type="test_gold_reward.gold_fn", gold_reward_key="gold", custom_rm_path=None)
    assert gold_rewards(args, samples()) == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="set --reward-key"):
        gold_rewards(schema_args("rl", gold_rm_type="test_gold_reward.gold_fn"), samples())
