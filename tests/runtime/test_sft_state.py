"""The SFT driver's resumable state: row order, caption-dropout generator, `--load` / `--start-rollout-id`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.runtime.train_sft import RowSampler, _generator_state, _set_generator_state, resume, save


class FakeGroup:
    """A trainer group whose checkpoint is a dict: `save_checkpoint` keeps `extra`, `load_checkpoint` returns it."""

    def __init__(self) -> None:
        self.extra: dict[str, Any] = {}
        self.calls: list[tuple[Any, ...]] = []

    def call(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, *args))
        if method == "save_checkpoint":
            self.extra = json.loads(json.dumps(args[2]))  # it travels as extra.json
            return [None]
        return [dict(self.extra)]


def _args(**changes: Any) -> Args:
    return schema_args(**{"save": "ck", **changes})


def test_row_sampler_state_resumes_the_same_order() -> None:
    straight = RowSampler(10, seed=3)
    drawn = [straight.take(4) for _ in range(5)]  # crosses two epoch boundaries
    assert sorted(drawn[0] + drawn[1] + drawn[2][:2]) == list(range(10))  # epoch 0 is a permutation
    first = RowSampler(10, seed=3)
    first.take(4), first.take(4), first.take(4)
    state = json.loads(json.dumps(first.state_dict()))  # it travels in extra.json
    assert state == {"size": 10, "seed": 3, "epoch": 1, "offset": 2}
    resumed = RowSampler(10, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.take(4) for _ in range(2)] == drawn[3:]
    with pytest.raises(ConfigError, match="trained on 10 SFT rows, --prompt-data has 11"):
        RowSampler(11, seed=3).load_state_dict(state)


def test_generator_state_round_trips_through_text() -> None:
    gen = torch.Generator().manual_seed(5)
    torch.rand(7, generator=gen)
    text = json.loads(json.dumps(_generator_state(gen)))
    expected = torch.rand(4, generator=gen)
    other = torch.Generator().manual_seed(99)
    _set_generator_state(other, text)
    assert torch.equal(torch.rand(4, generator=other), expected)


def _drawn(sampler: RowSampler, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    return sampler.take(4), torch.rand(4, generator=gen)


def test_resume_restores_the_row_order_and_the_generator() -> None:
    group = FakeGroup()
    sampler, gen = RowSampler(10, seed=1), torch.Generator().manual_seed(1)
    for _ in range(3):
        _drawn(sampler, gen)
    save(_args(), group, 2, sampler, gen)
    assert group.calls[-1][:3] == ("save_checkpoint", "ck", 2) and group.extra["rollout_id"] == 2
    expected = _drawn(sampler, gen)

    fresh, fresh_gen = RowSampler(10, seed=1), torch.Generator().manual_seed(1)
    assert resume(_args(load="ck", ckpt_step=2), group, fresh, fresh_gen) == 3  # the next iteration
    assert group.calls[-1] == ("load_checkpoint", "ck", 2)
    rows, noise = _drawn(fresh, fresh_gen)
    assert rows == expected[0] and torch.equal(noise, expected[1])


def test_no_load_rng_keeps_the_seeded_generator_but_the_row_order() -> None:
    group = FakeGroup()
    sampler, gen = RowSampler(10, seed=1), torch.Generator().manual_seed(1)
    _drawn(sampler, gen)
    save(_args(), group, 0, sampler, gen)
    expected_rows = sampler.take(4)
    fresh, fresh_gen = RowSampler(10, seed=1), torch.Generator().manual_seed(1)
    assert resume(_args(load="ck", no_load_rng=True), group, fresh, fresh_gen) == 1
    assert fresh.take(4) == expected_rows
    assert torch.equal(torch.rand(4, generator=fresh_gen), torch.rand(4, generator=torch.Generator().manual_seed(1)))


def test_start_rollout_id_wins_as_in_train_rl() -> None:
    group = FakeGroup()
    save(_args(), group, 4, RowSampler(10, seed=1), torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)
    assert resume(_args(load="ck", start_rollout_id=2), group, RowSampler(10, seed=1), gen) == 2
    assert resume(_args(start_rollout_id=7), FakeGroup(), RowSampler(10, seed=1), gen) == 7  # without --load
    assert resume(_args(), FakeGroup(), RowSampler(10, seed=1), gen) == 0
