"""Issue 32's methods on a family beyond sd3: tiny-flux trains 2 rollouts of each through the CLI (Ray, trainer
group, engine) — Flow-GRPO-Fast (a shared prefix branching at a 2-step window) with GRPO-Guard, and MixGRPO-Flash
(the sliding window, DPM-Solver++ 2M on a compressed schedule). DPO's run is in tests/e2e/test_dpo_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

SMALL = [
    "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
    "--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "6", "--lr-warmup-iters", "0",
    "--num-rollout", "2",
]  # fmt: skip
METHODS = {
    "fast+guard": [
        "--diffusion-shared-prefix", "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4",
        "--diffusion-grpo-guard", "--diffusion-clip-range", "4e-3",
    ],
    "mixgrpo-flash": [
        "--diffusion-step-strategy-path", "miles.sampling.step_strategies.mix_grpo_window",
        "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,5", "--diffusion-sde-window-interval",
        "1", "--diffusion-shared-prefix",
        "--diffusion-ode-solver", "dpmpp_2m", "--diffusion-post-sde-steps-ratio", "0.4",
    ],
}  # fmt: skip


# mixgrpo-flash is extended (~50 s, a job): its rollout plan (the window, DPM-Solver++ 2M on the compressed schedule,
# 3 denoiser calls a sample at rollout 0) is tests/rollout/test_manager_sampling_plans.py::
# test_flash_rollouts_count_fewer_denoiser_calls and tests/rollout/test_engine_sampling_plans.py::
# test_dpm_solver_after_the_window_and_the_compressed_schedule, and a tiny-flux job training on shared-prefix
# rollouts is the fast+guard case, in the default suite
@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.extended) if m == "mixgrpo-flash" else m for m in sorted(METHODS)]
)
def test_tiny_flux_trains_two_rollouts(
    method: str, tiny_flux_dir: Path, tmp_path: Path, small_digit_eval: list[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "rl", "--recipe", "tiny-flux-digits-grpo", "--hf-checkpoint", str(tiny_flux_dir), *SMALL]
    assert main([*argv, *METHODS[method], *small_digit_eval, "--output-dir", str(out)]) == 0
    *rows, final = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1] and "eval/digits/accuracy" in final
    for row in rows:
        assert torch.isfinite(torch.tensor(row["train/loss"])) and row["train/grad_norm"] > 0
        assert row["rollout/denoiser_calls"] < 8 * 6  # 8 samples of 6 steps, each its own: 48
    if method == "fast+guard":
        assert rows[0]["train/ratio_bias"] < 1e-8  # on-policy first step: the trainer's means are the engine's
    else:  # rollout 0: window [0, 1] (branch at 0), then 2 points after step 1: 3 steps for every sample
        assert rows[0]["rollout/denoiser_calls"] == 8 * 3
    assert (out / "checkpoint" / "transformer").is_dir()
