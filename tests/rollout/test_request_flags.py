"""The sampling flags as the engines receive them: `build_requests` turns the args into one `GenerateRequest`
per microgroup (what every engine, diffusers or sglang, samples from). Fast: no engine, no model."""

from __future__ import annotations

from typing import Any

import pytest

from miles.config.resolve import resolve
from miles.core.sample import Sample
from miles.rollout.manager import build_requests
from miles.sampling.step_strategies import resolve_step_strategy


def groups(n_groups: int = 2, n: int = 4) -> list[list[Sample]]:
    return [
        [Sample(index=g * n + i, group_index=g, prompt=f"p{g}", seed=100 * g + i) for i in range(n)]
        for g in range(n_groups)
    ]


def requests_for(recipe: str, evaluation: bool = False, **cli: Any):
    args = resolve("rl", recipe=recipe, cli=cli).args
    return args, build_requests(args, groups(), resolve_step_strategy(args), evaluation=evaluation)


@pytest.mark.parametrize(
    ("recipe", "cli"),
    [
        (
            "tiny-digits-grpo",
            {
                "diffusion_num_steps": 7,
                "diffusion_guidance_scale": 2.5,
                "diffusion_height": 48,
                "diffusion_width": 80,
                "diffusion_noise_level": 0.4,
                "diffusion_num_sde_steps": 2,
                "diffusion_sde_window_range": "0,6",
            },
        ),
        (
            "tiny-qwen-image-digits-grpo",
            {"diffusion_true_cfg_scale": 3.0, "diffusion_negative_prompt": "blurry, low quality"},
        ),
        (
            "tiny-wan2_2-digits-grpo",
            {"diffusion_guidance_scale_2": 2.5, "diffusion_fps": 8.0, "diffusion_output_num_frames": 5},
        ),
    ],
)
def test_requests_carry_the_sampling_flags(recipe: str, cli: dict[str, Any]) -> None:
    args, requests = requests_for(recipe, rollout_microgroup_size=2, **cli)
    assert len(requests) == 4  # 2 groups x 4 samples in microgroups of 2
    for request in requests:
        assert request.num_steps == args.diffusion_num_steps
        assert request.guidance_scale == args.diffusion_guidance_scale
        assert (request.height, request.width) == (args.diffusion_height, args.diffusion_width)
        assert (request.noise_level, request.sde_type) == (args.diffusion_noise_level, args.diffusion_sde_type)
        assert request.negative_prompt == args.diffusion_negative_prompt
        assert request.true_cfg_scale == args.diffusion_true_cfg_scale
        assert request.guidance_scale_2 == args.diffusion_guidance_scale_2
        assert (request.num_frames, request.fps) == (args.diffusion_output_num_frames, args.diffusion_fps)
        assert not request.evaluation and not request.debug
        assert all(len(steps) == args.diffusion_num_sde_steps for steps in request.sde_steps)
        assert all(0 <= step < args.diffusion_num_steps for steps in request.sde_steps for step in steps)
    for dest, value in cli.items():  # what was set is what the engine gets
        if dest in ("diffusion_num_sde_steps", "diffusion_sde_window_range"):
            continue
        assert getattr(args, dest) == (pytest.approx(value) if isinstance(value, float) else value)


def test_evaluation_requests_take_the_eval_steps_and_no_noise() -> None:
    _, train = requests_for("tiny-digits-grpo", diffusion_num_steps=10, diffusion_eval_num_steps=4)
    _, evaluation = requests_for("tiny-digits-grpo", True, diffusion_num_steps=10, diffusion_eval_num_steps=4)
    assert {r.num_steps for r in train} == {10} and {r.num_steps for r in evaluation} == {4}
    assert all(r.evaluation and r.noise_level == 0.0 and r.sde_type == "ode" for r in evaluation)
    assert all(steps == [] for r in evaluation for steps in r.sde_steps)  # nothing stochastic to record
    _, unset = requests_for("tiny-digits-grpo", True, diffusion_num_steps=10)
    assert {r.num_steps for r in unset} == {10}  # without --diffusion-eval-num-steps: the rollout's steps
