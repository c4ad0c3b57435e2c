"""GARDO's diversity-aware advantage (`--advantage-estimator gardo`, algorithms_next.md E.2 item 1, E.6.1)."""

from __future__ import annotations

import pytest
import torch

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rollout.advantages import gardo_advantages, post_process_rewards


def test_the_numbers_of_e6_1() -> None:
    rewards = torch.tensor([0.2, 0.5, 0.8, 0.9])
    features = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
    a = gardo_advantages(rewards, features, 4)
    assert a.tolist() == pytest.approx([-0.4, -0.1, 1 / 3, 0.1], abs=1e-6)
    # the multipliers: the distinct good sample #2 is pushed 1.667x, the near-duplicate #3 only 0.333x
    assert (a / (rewards.double() - 0.6)).tolist() == pytest.approx([1, 1, 5 / 3, 1 / 3], abs=1e-6)


def peer_gardo(rewards: list[float], features: list[list[float]]) -> list[float]:
    """flow_grpo's `PerPromptStatTracker.update(type='gardo')` for one prompt, as the note states it."""
    f = torch.nn.functional.normalize(torch.tensor(features, dtype=torch.float64), dim=1)
    n, mean = len(rewards), sum(rewards) / len(rewards)
    deltas = [min(1 - max(-1.0, min(1.0, float(f[i] @ f[j]))) for j in range(n) if j != i) for i in range(n)]
    avg = sum(deltas) / n
    return [(r - mean) * (1.0 if r < mean else d / avg) for r, d in zip(rewards, deltas, strict=True)]


def test_two_groups_match_the_peers_formula() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, features = torch.rand(12, generator=g, dtype=torch.float64), torch.randn(12, 7, generator=g)
    ours = gardo_advantages(rewards, features, 6)
    for start in (0, 6):
        expected = peer_gardo(rewards[start : start + 6].tolist(), features[start : start + 6].tolist())
        assert ours[start : start + 6].tolist() == pytest.approx(expected, abs=1e-6)


def test_identical_outputs_leave_the_centred_reward() -> None:
    a = gardo_advantages(torch.tensor([0.1, 0.3]), torch.ones(2, 3), 2)
    assert a.tolist() == pytest.approx([-0.1, 0.1])


def test_the_estimator_runs_on_the_samples_images() -> None:
    black, white = torch.zeros(3, 8, 8), torch.ones(3, 8, 8)
    images = [black, black, white, black]  # the best two: #2 (unlike the rest) and #3 (a duplicate of #0, #1)
    samples = [
        Sample(index=i, group_index=0, prompt="p", image=img + 0.01 * i, reward=r)
        for i, (img, r) in enumerate(zip(images, [0.1, 0.2, 0.9, 0.8], strict=True))
    ]
    args = schema_args("rl", advantage_estimator="gardo", n_samples_per_prompt=4)
    _, adv = post_process_rewards(args, samples)
    assert adv[0] < 0 and adv[1] < 0 and adv[2] > adv[3] > 0
    assert [s.advantage for s in samples] == adv


def test_grpos_group_statistics_flags_are_refused_with_it() -> None:
    def job(**cli):
        return resolve("rl", recipe="tiny-digits-grpo", cli={"advantage_estimator": "gardo", **cli})

    assert job(globalize_reward_std=False).args.advantage_estimator == "gardo"
    with pytest.raises(ConfigError, match="uses the prompt's mean and no std"):
        job()  # the recipe globalizes the std
    with pytest.raises(ConfigError, match="would not run"):
        job(globalize_reward_std=False, custom_reward_post_process_path="my.post")
