"""Weighted multi-reward (`--rm-type a,b`, `--reward-weights`, `--reward-component-norm`): the flags, the config's
rules, the dispatch's weighted sum and components, the per-component metrics and the advantages of each norm."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.rewards import is_multi_reward, reward_components
from miles.rewards.dispatch import batched_async_rm, score_samples
from miles.rewards.scorers.jpeg import jpeg_compressibility, jpeg_incompressibility
from miles.rollout.advantages import grpo_advantages, post_process_rewards
from miles.rollout.reward_metrics import component_metrics

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


def images(n: int) -> list[torch.Tensor]:
    """Images of growing detail: flat grey, then more and more noise (JPEG sizes differ)."""
    gen = torch.Generator().manual_seed(0)
    return [(0.5 + (i / n) * (torch.rand(3, 32, 32, generator=gen) - 0.5)).clamp(0, 1) for i in range(n)]


def make_samples(n: int, group: int = 2) -> list[Sample]:
    return [
        Sample(index=i, group_index=i // group, prompt=f"p{i // group}", image=im) for i, im in enumerate(images(n))
    ]


# ---- flags and rules ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        "jpeg_compressibility=1,jpeg_incompressibility=0.25",
        "{jpeg_compressibility: 1, jpeg_incompressibility: 0.25}",
        '{"jpeg_compressibility": 1, "jpeg_incompressibility": 0.25}',
        {"jpeg_compressibility": 1, "jpeg_incompressibility": 0.25},
    ],
)
def test_reward_weights_parse_from_cli_text_and_yaml_mapping(raw: object) -> None:
    args = resolve("rl", cli={**JOB, "reward_weights": raw}).args
    assert args.reward_weights == {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}
    assert reward_components(args) == (("jpeg_compressibility", 1.0), ("jpeg_incompressibility", 0.25))
    assert is_multi_reward(args)


def test_rm_type_list_gives_weight_one_each_and_one_type_is_not_multi() -> None:
    args = resolve("rl", cli={**JOB, "rm_type": "digit,jpeg_compressibility"}).args
    assert reward_components(args) == (("digit", 1.0), ("jpeg_compressibility", 1.0))
    assert is_multi_reward(args)
    single = resolve("rl", cli={**JOB, "rm_type": "digit"}).args
    assert reward_components(single) == (("digit", 1.0),) and not is_multi_reward(single)


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"reward_weights": "digit=1,nope=2"}, "'nope' is not one of"),
        ({"reward_weights": "digit=1,digit=2"}, "'digit' is given twice"),
        ({"reward_weights": "digit=x"}, "the weight of 'digit' is not a number"),
        ({"reward_weights": "digit=inf"}, "must be a finite number"),
        ({"reward_weights": "digit"}, "is not NAME=WEIGHT"),
        ({"rm_type": "digit,ocr", "reward_weights": "digit=1"}, "name different rewards"),
        ({"rm_type": "digit,digit"}, "a reward type is given twice"),
        ({"rm_type": "digit", "reward_component_norm": "group"}, "normalises each of several rewards"),
        ({"reward_weights": "digit=1,pickscore=1"}, "pickscore requires --pickscore-model-path"),
        ({"rm_type": "digit,remote_rm"}, "remote_rm requires --rm-url"),
    ],
)
def test_bad_reward_combinations_are_refused_naming_the_flag(cli: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve("rl", cli={**JOB, **cli})


# ---- dispatch ----------------------------------------------------------------------------------
def test_combined_reward_is_the_weighted_sum_and_components_are_kept() -> None:
    args = schema_args(reward_weights={"jpeg_compressibility": 2.0, "jpeg_incompressibility": -0.5})
    samples = make_samples(4)
    rewards = asyncio.run(score_samples(args, samples))
    ims = [s.image for s in samples]
    comp, incomp = jpeg_compressibility(ims), jpeg_incompressibility(ims)
    assert len(set(incomp)) == 4  # the images differ, so the test can tell the weights apart
    for i, sample in enumerate(samples):
        assert sample.reward_components == {"jpeg_compressibility": comp[i], "jpeg_incompressibility": incomp[i]}
        assert sample.reward == rewards[i] == math.fsum([2.0 * comp[i], -0.5 * incomp[i]])
    # the plain dispatch returns the same combined values
    assert asyncio.run(batched_async_rm(args, make_samples(4))) == rewards


def test_metadata_rm_type_overrides_the_combination_for_its_sample() -> None:
    args = schema_args(rm_type=["jpeg_compressibility", "jpeg_incompressibility"])
    samples = make_samples(2)
    samples[1].metadata = {"rm_type": "jpeg_incompressibility"}
    asyncio.run(score_samples(args, samples))
    assert samples[1].reward == jpeg_incompressibility([samples[1].image])[0]
    assert samples[1].reward_components == {"jpeg_incompressibility": samples[1].reward}
    assert set(samples[0].reward_components or {}) == {"jpeg_compressibility", "jpeg_incompressibility"}


def test_one_reward_job_keeps_plain_rewards() -> None:
    args = schema_args(rm_type=["jpeg_incompressibility"])
    samples = make_samples(2)
    asyncio.run(score_samples(args, samples))
    assert samples[0].reward_components is None
    assert samples[0].reward == jpeg_incompressibility([samples[0].image])[0]


def test_component_metrics_per_reward_type() -> None:
    samples = make_samples(3)
    for i, s in enumerate(samples):
        s.reward_components = {"digit": 0.1 * i, "ocr": 1.0}
    metrics = component_metrics("rollout/reward", samples)
    assert metrics["rollout/reward/digit/raw_mean"] == pytest.approx(0.1)
    assert metrics["rollout/reward/digit/raw_std"] == pytest.approx(math.sqrt(2 / 300))
    assert metrics["rollout/reward/ocr/raw_mean"] == 1.0 and metrics["rollout/reward/ocr/raw_std"] == 0.0
    assert component_metrics("rollout/reward", make_samples(2)) == {}


# ---- advantages --------------------------------------------------------------------------------
def scored(args: object) -> list[Sample]:
    samples = make_samples(6, group=3)
    digit = [0.9, 0.1, 0.5, 0.2, 0.8, 0.3]
    kb = [1.0, 3.0, 2.0, 5.0, 4.0, 4.5]
    for s, d, k in zip(samples, digit, kb, strict=True):
        s.reward_components = {"digit": d, "jpeg_incompressibility": k}
        s.reward = 1.0 * d + 0.1 * k
    return samples


def norm_args(norm: str) -> object:
    return schema_args(
        reward_weights={"digit": 1.0, "jpeg_incompressibility": 0.1},
        reward_component_norm=norm,
        n_samples_per_prompt=3,
    )


def test_component_norm_none_is_the_estimator_on_the_weighted_sum() -> None:
    samples = scored(norm_args("none"))
    _, adv = post_process_rewards(norm_args("none"), samples)
    expected = grpo_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), 3)
    assert adv == pytest.approx(expected.tolist(), abs=1e-12)


def test_component_norm_group_sums_each_rewards_own_advantage() -> None:
    args = norm_args("group")
    samples = scored(args)
    _, adv = post_process_rewards(args, samples)
    d = grpo_advantages(torch.tensor([0.9, 0.1, 0.5, 0.2, 0.8, 0.3], dtype=torch.float64), 3)
    k = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0, 4.5], dtype=torch.float64), 3)
    assert adv == pytest.approx((1.0 * d + 0.1 * k).tolist(), abs=1e-12)


def test_component_norm_batch_zscores_each_reward_over_the_rollout_then_estimates() -> None:
    args = norm_args("batch")
    samples = scored(args)
    _, adv = post_process_rewards(args, samples)
    d = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.8, 0.3], dtype=torch.float64)
    k = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0, 4.5], dtype=torch.float64)
    combined = (d - d.mean()) / (d.std() + 1e-4) + 0.1 * (k - k.mean()) / (k.std() + 1e-4)
    assert adv == pytest.approx(grpo_advantages(combined, 3).tolist(), abs=1e-12)


def test_component_norm_needs_every_component_on_every_sample() -> None:
    args = norm_args("group")
    samples = scored(args)
    samples[4].reward_components = {"digit": 0.8}
    with pytest.raises(ValueError, match="sample 4 has no 'jpeg_incompressibility' score"):
        post_process_rewards(args, samples)
