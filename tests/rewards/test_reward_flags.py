"""--pickscore-batch-size (the PickScore forward's chunk) and --rm-url (a value for the user's reward function),
through the reward dispatch `batched_async_rm`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.core.sample import Sample
from miles.rewards.dispatch import batched_async_rm
from miles.rewards.scorers.pickscore import PickScoreScorer

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def samples(n: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, group_index=0, prompt=f"a photo {i}", image=torch.rand(3, 32, 32, generator=gen))
        for i in range(n)
    ]


def url_rm(args: Any, batch: list[Sample], **kwargs: Any) -> list[float]:
    """A user's reward function: it asks the service at --rm-url (here: the URL's length stands for the answer)."""
    return [float(len(args.rm_url))] * len(batch)


def test_rm_url_reaches_the_custom_reward_function() -> None:
    args = resolve("rl", cli={**JOB, "custom_rm_path": f"{__name__}.url_rm", "rm_url": "http://rm:8000"}).args
    assert asyncio.run(batched_async_rm(args, samples(3))) == [14.0] * 3


@pytest.mark.slow
@pytest.mark.parametrize(("batch_size", "chunks"), [(2, [2, 2, 1]), (8, [5])])
def test_pickscore_batch_size_is_the_scorers_batch(
    tiny_clip: tuple[str, str], monkeypatch: pytest.MonkeyPatch, batch_size: int, chunks: list[int]
) -> None:
    model_dir, processor_dir = tiny_clip
    seen: list[int] = []
    chunk = PickScoreScorer._score_chunk

    def recording(self: PickScoreScorer, images: list, prompts: list[str]) -> list[float]:
        seen.append(len(images))
        return chunk(self, images, prompts)

    monkeypatch.setattr(PickScoreScorer, "_score_chunk", recording)
    cli = {"rm_type": "pickscore", "pickscore_model_path": model_dir, "pickscore_processor_path": processor_dir}
    args = resolve("rl", cli={**JOB, **cli, "pickscore_batch_size": batch_size}).args
    rewards = asyncio.run(batched_async_rm(args, samples(5), pools={}))
    assert seen == chunks and len(rewards) == 5
