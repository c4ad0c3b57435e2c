"""GRPO advantages, the flow_grpo per-prompt tracker numbers, post-processing flags and filters."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rollout.advantages import grpo_advantages, per_prompt_advantages, post_process_rewards
from miles.rollout.filter_hub import (
    DynamicFilterOutput,
    apply_dynamic_filter,
    apply_sample_filter,
    check_reward_nonzero_std,
    get_dynamic_filter,
)

EPS = 1e-4
# Two groups of n=3 (hand example): [1, 2, 6] and [4, 4, 7]. Group means 3 and 5; unbiased group stds
# sqrt(((-2)^2 + (-1)^2 + 3^2) / 2) = sqrt(7) and sqrt((1 + 1 + 4) / 2) = sqrt(3).
REWARDS = [1.0, 2.0, 6.0, 4.0, 4.0, 7.0]
S7, S3 = math.sqrt(7) + EPS, math.sqrt(3) + EPS
PER_GROUP = [-2 / S7, -1 / S7, 3 / S7, -1 / S3, -1 / S3, 2 / S3]
# global unbiased std of all six rewards: mean 4, squares 9+4+4+0+0+9 = 26, / 5
GLOBAL_STD = math.sqrt(26 / 5)
GLOBAL_STD_ADV = [d / (GLOBAL_STD + EPS) for d in (-2, -1, 3, -1, -1, 2)]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_close(actual, expected, tol=1e-9) -> None:
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64), t(expected), atol=tol, rtol=0), (
        actual,
        expected,
    )


def test_hand_example_per_group_std() -> None:
    assert_close(grpo_advantages(t(REWARDS), 3), PER_GROUP)
    assert PER_GROUP[0] == pytest.approx(-0.755900, abs=1e-6)


def test_hand_example_global_std() -> None:
    assert_close(grpo_advantages(t(REWARDS), 3, globalize_std=True), GLOBAL_STD_ADV)
    assert abs(GLOBAL_STD - 2.280351) < 1e-6


@pytest.mark.parametrize("globalize_std", [False, True])
def test_group_mean_is_zero(globalize_std: bool) -> None:
    rewards = torch.randn(40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = grpo_advantages(rewards, 8, globalize_std=globalize_std)
    assert adv.reshape(-1, 8).sum(dim=-1).abs().max() < 1e-9


def test_global_mean_and_no_std() -> None:
    adv = grpo_advantages(t(REWARDS), 3, globalize_mean=True, std_normalization=False)
    assert_close(adv, [r - 4.0 for r in REWARDS])
    adv = grpo_advantages(t(REWARDS), 3, globalize_mean=True, globalize_std=True)
    assert_close(adv, [(r - 4.0) / (GLOBAL_STD + EPS) for r in REWARDS])
    assert_close(grpo_advantages(t(REWARDS), 3, std_normalization=False), [-2, -1, 3, -1, -1, 2])


def test_n_equal_one_disables_std() -> None:
    assert_close(grpo_advantages(t([1.0, 5.0, 2.0]), 1), [0.0, 0.0, 0.0])  # per-group mean of a single sample
    assert_close(grpo_advantages(t([1.0, 5.0, 3.0]), 1, globalize_mean=True, globalize_std=True), [-2.0, 2.0, 0.0])


def test_incomplete_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        grpo_advantages(t([1.0, 2.0, 3.0]), 4)


def test_int_input_becomes_float32() -> None:
    adv = grpo_advantages(torch.tensor([0, 1, 1, 0]), 2)
    assert adv.dtype == torch.float32
    a = 0.5 / (math.sqrt(0.5) + EPS)  # each group: mean 0.5, unbiased std sqrt(0.5)
    assert_close(adv.double(), [-a, a, a, -a], tol=1e-6)


# --- flow_grpo PerPromptStatTracker (reference D.6.1) ------------------------------------------


def test_per_prompt_tracker_reference_numbers() -> None:
    prompts = ["a", "b", "a", "c", "b", "a"]
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert_close(
        per_prompt_advantages(prompts, rewards, global_std=False),
        [-1.135495, -0.999933, -0.162214, 0.0, 0.999933, 1.297708],
        tol=1e-6,
    )
    assert_close(
        per_prompt_advantages(prompts, rewards, global_std=True),
        [-1.366180, -0.878259, -0.195169, 0.0, 0.878259, 1.561349],
        tol=1e-6,
    )
    assert torch.tensor(rewards).std(correction=0).item() == pytest.approx(1.707825, abs=1e-6)


# --- post_process_rewards ------------------------------------------------------------------------


def make_samples(rewards, n, **fields) -> list[Sample]:
    return [
        Sample(index=i, group_index=i // n, prompt=f"p{i // n}", reward=r, **fields) for i, r in enumerate(rewards)
    ]


def make_args(**kw) -> Args:
    base = dict(
        n_samples_per_prompt=3,
    )
    base.update(kw)
    return schema_args(**base)


def test_post_process_sets_advantages() -> None:
    samples = make_samples(REWARDS, 3)
    raw, adv = post_process_rewards(make_args(), samples)
    assert raw == REWARDS
    assert_close(adv, PER_GROUP)
    assert_close([s.advantage for s in samples], PER_GROUP)
    raw, adv = post_process_rewards(make_args(globalize_reward_std=True), samples)
    assert_close(adv, GLOBAL_STD_ADV)
    raw, adv = post_process_rewards(make_args(disable_grpo_std_normalization=True), samples)
    assert_close(adv, [-2, -1, 3, -1, -1, 2])
    raw, adv = post_process_rewards(
        make_args(globalize_reward_mean=True, disable_grpo_std_normalization=True), samples
    )
    assert_close(adv, [r - 4.0 for r in REWARDS])


def test_post_process_dict_rewards_use_reward_key() -> None:
    samples = make_samples([{"a": r, "b": 0.0} for r in REWARDS], 3)
    raw, adv = post_process_rewards(make_args(reward_key="a"), samples)
    assert raw == REWARDS
    assert_close(adv, PER_GROUP)
    with pytest.raises(ValueError, match="--reward-key"):
        post_process_rewards(make_args(), samples)


def test_removed_samples_still_count() -> None:
    samples = make_samples(REWARDS, 3)
    samples[2].remove_sample = True
    samples[3].remove_sample = True
    _, adv = post_process_rewards(make_args(), samples)
    assert_close(adv, PER_GROUP)


def test_post_process_checks_group_layout() -> None:
    samples = make_samples(REWARDS, 3)
    samples[1].group_index = 7
    with pytest.raises(ValueError, match="should form one prompt group"):
        post_process_rewards(make_args(), samples)


def double_rewards(args, samples):
    raw = [s.scalar_reward() for s in samples]
    return raw, [2 * r for r in raw]


def test_custom_post_process_hook() -> None:
    samples = make_samples(REWARDS, 3)
    raw, adv = post_process_rewards(make_args(custom_reward_post_process_path=f"{__name__}.double_rewards"), samples)
    assert raw == REWARDS and adv == [2 * r for r in REWARDS]
    assert [s.advantage for s in samples] == adv
    with pytest.raises(ConfigError, match=r"--custom-reward-post-process-path 'nope\.mod\.fn'"):
        post_process_rewards(make_args(custom_reward_post_process_path="nope.mod.fn"), samples)


# --- filters ---------------------------------------------------------------------------------


def test_check_reward_nonzero_std() -> None:
    args = make_args()
    assert check_reward_nonzero_std(args, make_samples([1.0, 2.0, 1.0], 3)) == DynamicFilterOutput(keep=True)
    out = check_reward_nonzero_std(args, make_samples([0.3, 0.3, 0.3], 3))
    assert out.keep is False and out.reason == "zero_std_0.3"


def test_apply_dynamic_filter() -> None:
    samples = make_samples([1.0, 2.0, 3.0, 5.0, 5.0, 5.0], 3)
    groups = [samples[:3], samples[3:]]
    assert apply_dynamic_filter(make_args(), groups) == (groups, {})
    assert get_dynamic_filter(make_args()) is None
    args = make_args(dynamic_sampling_filter_path="miles.rollout.filter_hub.check_reward_nonzero_std")
    kept, dropped = apply_dynamic_filter(args, groups)
    assert kept == [groups[0]] and dropped == {"zero_std_5.0": 1}
    args = make_args(dynamic_sampling_filter_path=f"{__name__}.reject_all")
    assert apply_dynamic_filter(args, groups) == ([], {"filtered": 2})


def reject_all(args, samples, **kwargs):
    return False


def remove_low(args, data):
    for group in data:
        for sample in group:
            if sample.scalar_reward() < 2:
                sample.remove_sample = True


def test_apply_sample_filter() -> None:
    samples = make_samples([1.0, 2.0, 3.0, 0.0, 5.0, 5.0], 3)
    groups = [samples[:3], samples[3:]]
    assert apply_sample_filter(make_args(), groups) == 0
    assert apply_sample_filter(make_args(rollout_sample_filter_path=f"{__name__}.remove_low"), groups) == 2
    assert [s.remove_sample for s in samples] == [True, False, False, True, False, False]
    with pytest.raises(ConfigError, match="--rollout-sample-filter-path"):
        apply_sample_filter(make_args(rollout_sample_filter_path=f"{__name__}.missing"), groups)
