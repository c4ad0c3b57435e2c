"""Reward actor pools on a local Ray (one `ray.init` for the whole module; the tests are slow).

The cluster has 2 CPUs and each worker takes one, so every test shuts its pool down before the next.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.sample import Sample
from miles.rewards.dispatch import RewardError, batched_async_rm, get_reward_pools
from miles.rewards.scorers.jpeg import jpeg_compressibility
from miles.rewards.scorers.ocr import ocr_reward

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]


def text_image(text: str, size: int = 128) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((8, size // 3), text, fill="black", font=ImageFont.load_default(28))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


def make_args(**overrides) -> Args:
    return schema_args(**{"ocr_num_workers": 2, **overrides})


def test_ocr_pool_round_trip_dispatch_and_worker_error():
    from miles.rewards.pool import make_reward_pools, shutdown_reward_pools

    args = make_args(rm_type="ocr")
    pools = make_reward_pools(args)  # --ocr-num-workers 2, registered for the dispatch
    try:
        assert list(pools) == ["ocr"] and get_reward_pools() == pools
        pool = pools["ocr"]
        assert pool.num_workers == 2 and pool.num_gpus_per_worker == 0.0
        images = [text_image("HELLO"), torch.ones(3, 128, 128), text_image("WORLD"), text_image("HELL0")]
        prompts = ['a sign "hello"', 'a sign "hello"', 'a poster "world"', 'a sign "hello"']
        samples = [
            Sample(index=10 + i, group_index=0, prompt=p, image=im)
            for i, (im, p) in enumerate(zip(images, prompts, strict=True))
        ]
        expected = ocr_reward(images, prompts)  # in-process engine
        assert expected[0] >= 0.8 and expected[1] == 0.0 and expected[2] >= 0.8
        assert asyncio.run(pool.score(samples)) == expected  # 2 chunks of 2, one per worker
        assert pool.score_sync(samples) == expected
        assert asyncio.run(batched_async_rm(args, samples)) == expected  # dispatch goes through the pool
        bad = [*samples[:2], Sample(index=12, group_index=0, prompt="no quotes at all", image=images[0])]
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"'ocr'.*sample 12 \(prompt 'no quotes at all'\).*double quotes"):
            asyncio.run(pool.score(bad))
        assert time.monotonic() - start < 30
    finally:
        shutdown_reward_pools()
    assert get_reward_pools() == {}


def _wait_until_dead(ray_module, actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray_module.get(actor.ready.remote(), timeout=5)
        except ray_module.exceptions.RayActorError:
            return
        except ray_module.exceptions.GetTimeoutError:
            continue
        time.sleep(0.05)
    raise AssertionError("the killed reward worker still answers")


def test_pool_cpu_only_placement_and_dead_worker(local_ray):
    from miles.core.errors import ConfigError
    from miles.rewards.pool import RewardPool, reward_types_in_use

    assert reward_types_in_use(make_args(rm_type="ocr"), [{"rm_type": "pickscore"}, {}]) == ["ocr", "pickscore"]
    assert reward_types_in_use(make_args(rm_type="ocr", custom_rm_path="m.f")) == []
    with pytest.raises(ConfigError, match="--pickscore-model-path"):  # checked before any actor starts
        RewardPool(make_args(), "pickscore", 1)
    # a GPU request is dropped on a cluster without GPUs
    pool = RewardPool(make_args(), "jpeg_compressibility", num_workers=2, num_gpus_per_worker=1.0, timeout_s=60)
    try:
        assert pool.num_gpus_per_worker == 0.0
        images = [torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(5)]
        samples = [Sample(index=i, group_index=0, prompt="x", image=im) for i, im in enumerate(images)]
        assert pool.score_sync(samples) == jpeg_compressibility(images)
        local_ray.kill(pool.workers[0])
        _wait_until_dead(local_ray, pool.workers[0])  # ray.kill returns before the actor is gone
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"'jpeg_compressibility' worker 0 failed on 3 samples: sample 0"):
            asyncio.run(pool.score(samples))
        assert time.monotonic() - start < 30
    finally:
        pool.shutdown()
