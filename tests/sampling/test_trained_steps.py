"""What inspect-config says a job trains is what its rollouts draw (fast): each stock strategy's `candidate_steps`
equals the union of `select_steps` over many seeds and rollouts, also when
the draw is confined to the trained experts' steps; and the flags a rollout would refuse are refused at parse time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.sampling.step_strategies import candidate_steps, select_steps

HUB = "miles.sampling.step_strategies."
T = 10


def drawn(args: Any, allowed: list[int] | None, rollouts: int = 60, seeds: int = 40) -> set[int]:
    """Every SDE step the strategy gives over `rollouts` rollouts x `seeds` samples (epoch = group // batch)."""
    steps: set[int] = set()
    for rollout_id in range(rollouts):
        for seed in range(seeds):
            sample = SimpleNamespace(group_index=rollout_id * int(args.rollout_batch_size) + seed % 4)
            sde, _ = select_steps(args, sample, T, seed, allowed=allowed, rollout_id=rollout_id)
            steps.update(sde)
    return steps


EPOCH = {"diffusion_sde_candidate_steps": [1, 2, 3, 7]}
MIX = {"diffusion_num_sde_steps": 2, "diffusion_sde_window_interval": 1}
CASES = {
    "window": ("sde_window", {"diffusion_num_sde_steps": 2, "diffusion_sde_window_range": "1,7"}, None),
    "window, one expert": ("sde_window", {"diffusion_num_sde_steps": 2}, [5, 6, 7, 8, 9]),
    "epoch choice": ("epoch_global_random_choice", EPOCH, None),
    "epoch choice, one expert": ("epoch_global_random_choice", EPOCH, [0, 1, 2]),
    "mix": ("mix_grpo_window", MIX, None),
    # MixGRPO's stride: only every 3rd start is ever used (a window of 1: steps 0, 3, 6)
    "mix, stride 3": (
        "mix_grpo_window",
        {**MIX, "diffusion_num_sde_steps": 1, "diffusion_sde_window_stride": 3},
        None,
    ),
    # confined, the window range becomes [3, 10): the last step is drawn, unlike mix's own default [0, 9)
    "mix, one expert": ("mix_grpo_window", MIX, list(range(3, 10))),
    "plain Flow-GRPO": ("default_steps", {"diffusion_num_sde_steps": 0}, None),
    "plain Flow-GRPO, one expert": ("default_steps", {"diffusion_num_sde_steps": 0}, [0, 1, 2, 3]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_candidates_are_what_the_rollouts_draw(case: str) -> None:
    strategy, values, allowed = CASES[case]
    path = None if strategy == "default_steps" else HUB + strategy
    values = {"diffusion_num_sde_steps": 1, "diffusion_num_steps": T, "rollout_batch_size": 4, **values}
    args = schema_args("rl", diffusion_step_strategy_path=path, **values)
    found = candidate_steps(args, T, allowed)
    assert found is not None
    assert set(found.steps) == drawn(args, allowed), found.how


def test_a_stride_is_said() -> None:
    args = schema_args(
        "rl",
        diffusion_step_strategy_path=HUB + "mix_grpo_window",
        diffusion_num_sde_steps=1,
        diffusion_sde_window_stride=3,
    )
    found = candidate_steps(args, T)
    assert found is not None and found.steps == (0, 3, 6) and "start every 3 steps" in found.how


def test_a_custom_strategy_has_no_candidates() -> None:
    args = schema_args("rl", diffusion_step_strategy_path="my_pkg.steps.choose")
    assert candidate_steps(args, T) is None


def test_a_window_that_does_not_fit_the_trained_experts_steps_is_refused_before_launch() -> None:
    """Only transformer_2 trains on wan22's 10-step shift-3 grid (steps 3-9): a window of 8 cannot fit there, which
    the first rollout would raise; the config rules say so before anything starts."""
    cli = {
        "update_weight_target_module": "transformer_2",
        "diffusion_step_strategy_path": HUB + "sde_window",
        "diffusion_num_sde_steps": 8,
        "diffusion_sde_candidate_steps": None,
    }
    with pytest.raises(ConfigError) as excinfo:
        resolve(None, recipe="wan22-pickscore-grpo", cli=cli)
    assert "--diffusion-num-sde-steps 8 does not fit the SDE window [3, 10)" in str(excinfo.value)
    cli["diffusion_num_sde_steps"] = 2  # fits: drawn from transformer_2's steps only, no warning
    assert resolve(None, recipe="wan22-pickscore-grpo", cli=cli).warnings == []
