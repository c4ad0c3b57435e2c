"""MixGRPO's sliding window, DPM-Solver++ 2M and the Flash schedule (algorithms_next.md C.2, C.6), and the
strategy's config rules: the note's numbers, and MixGRPO's formulas written out here on the same inputs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.sampling import step_strategies as hub
from miles.sampling.ode_solvers import compress_after, data_prediction, dpmpp_2m_step, post_window_points
from miles.sampling.sde import shift_sigmas

MIX = "miles.sampling.step_strategies.mix_grpo_window"


# ---- the window schedule (C.6.1) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("interval", "k", "window"),
    [
        (25, 0, [0, 1, 2, 3]),
        (25, 24, [0, 1, 2, 3]),
        (25, 25, [1, 2, 3, 4]),
        (25, 299, [11, 12, 13, 14]),
        (20, 299, [14, 15, 16, 17]),  # Flash
        (1, 19, [19, 20, 21, 22]),
        (1, 20, [20, 21, 22]),  # the last windows are cut at M = 23
        (1, 21, [21, 22]),
        (1, 22, [22]),
        (1, 23, [0, 1, 2, 3]),  # MixGRPO: [] here (an all-ODE iteration), and [0, 1, 2, 3] one later
        (1, 24, [1, 2, 3, 4]),  # so from here on the cycle runs one iteration ahead of MixGRPO's
    ],
)
def test_the_window_schedule_of_c6_1(interval: int, k: int, window: list[int]) -> None:
    assert hub.mix_window(k, 0, 23, 4, interval, 1) == window


def test_a_stride_of_w_gives_verl_omnis_non_overlapping_windows() -> None:
    assert [hub.mix_window(k, 0, 10, 4, 1, 4) for k in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_every_window_is_non_empty_and_inside_the_range() -> None:
    for lo, hi, w, s in [(0, 23, 4, 1), (2, 9, 3, 2), (0, 9, 9, 1), (5, 6, 2, 1)]:
        for k in range(60):
            steps = hub.mix_window(k, lo, hi, w, 1, s)
            assert steps and lo <= steps[0] and steps[-1] < hi and len(steps) <= w


def test_the_strategy_reads_the_rollout_id_and_the_flags() -> None:
    args = schema_args(
        "rl",
        diffusion_num_sde_steps=2,
        diffusion_sde_window_interval=3,
        diffusion_step_strategy_path=MIX,
        rollout_batch_size=4,
    )
    sample = Sample(index=0, group_index=100, prompt="p")
    # in a rollout: the rollout id; default range: every step but the last (10 steps: [0, 9))
    got = [hub.select_steps(args, sample, 10, seed=k, rollout_id=k)[0] for k in range(0, 30, 3)]
    assert got == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 7], [7, 8], [8], [0, 1]]
    # every sample of a rollout, whatever its seed, gets the same window
    assert {tuple(hub.select_steps(args, sample, 10, seed=s, rollout_id=7)[0]) for s in range(20)} == {(2, 3)}
    # outside a rollout: the sample's epoch (group_index // rollout_batch_size = 25 -> move 8)
    assert hub.mix_grpo_window(args, sample, 10, 0)[0] == [8]


def test_the_strategys_rules() -> None:
    def job(**cli):
        return resolve("rl", recipe="tiny-digits-grpo", cli=cli)

    with pytest.raises(ConfigError, match="needs --diffusion-num-sde-steps > 0"):
        job(diffusion_step_strategy_path=MIX, diffusion_num_sde_steps=0)
    with pytest.raises(ConfigError, match="moves the window of the mix_grpo_window strategy"):
        job(diffusion_sde_window_interval=5)  # the recipe's strategy is sde_window
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        job(diffusion_post_sde_steps_ratio=0.0)
    with pytest.raises(ConfigError, match="has one sample each"):
        job(diffusion_shared_prefix=True, rollout_microgroup_size=1)
    ok = job(diffusion_step_strategy_path=MIX, diffusion_num_sde_steps=2, diffusion_sde_window_interval=3)
    assert ok.args.diffusion_sde_window_interval == 3 and ok.args.diffusion_sde_window_stride == 1


# ---- DPM-Solver++ 2M (C.6.3, C.6.4) -----------------------------------------------------------------

DATA_VAR = 0.25  # the toy: data ~ N(0, 0.25), so the exact velocity is known


def exact_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    s2 = DATA_VAR
    return x * (sigma - (1 - sigma) * s2) / ((1 - sigma) ** 2 * s2 + sigma**2)


def exact_solution(x: float, sigma: float, sigma_to: float) -> float:
    """The probability-flow ODE of the Gaussian toy carries x along x * std(sigma_to) / std(sigma)."""

    def std(s: float) -> float:
        return math.sqrt((1 - s) ** 2 * DATA_VAR + s**2)

    return x * std(sigma_to) / std(sigma)


def test_first_order_dpm_solver_is_the_euler_step_c6_3() -> None:
    x = torch.tensor([0.7], dtype=torch.float64)
    v = exact_velocity(x, 0.6)
    out = dpmpp_2m_step(x, data_prediction(x, v, 0.6), 0.6, 0.45)
    assert float(out) == pytest.approx(0.56875, abs=1e-6)
    assert float(out) == pytest.approx(float(x + (0.45 - 0.6) * v), abs=1e-6)


def solve(steps: int, second_order: bool) -> float:
    """x = 1 from sigma 0.9403 to 0.05 over a shift-3-uniform grid (C.6.4)."""
    u_from = 0.84  # shift_3(0.84) = 0.9403
    u_to = 0.05 / (3 - 2 * 0.05)  # shift_3(u_to) = 0.05
    grid = [float(shift_sigmas(u, 3.0)) for u in np.linspace(u_from, u_to, steps + 1)]
    x = torch.tensor([1.0], dtype=torch.float64)
    prev = None
    for s, t in itertools.pairwise(grid):
        m = data_prediction(x, exact_velocity(x, s), s).double()
        x = dpmpp_2m_step(x, m, s, t, *(prev if (prev and second_order) else (None, None))).double()
        prev = (m, s)
    return float(x)


def test_the_orders_of_accuracy_of_c6_4() -> None:
    exact = exact_solution(1.0, float(shift_sigmas(0.84, 3.0)), 0.05)
    assert exact == pytest.approx(0.5076931, abs=2e-6)
    note = {  # steps: (Euler error, DPM-Solver++ 2M error), the note's table
        4: (-2.25e-1, -3.10e-2),
        8: (-1.22e-1, 6.42e-2),
        64: (-1.67e-2, 4.04e-3),
        512: (-2.12e-3, 5.78e-5),
    }
    for steps, (euler, dpm) in note.items():
        assert solve(steps, False) - exact == pytest.approx(euler, rel=0.02)
        assert solve(steps, True) - exact == pytest.approx(dpm, rel=0.02)


def mixgrpo_2m(x, m, m_prev, s, t, s_prev):
    """MixGRPO's `multistep_dpm_solver_second_order_update` (midpoint) in the note's notation, written out."""
    lam = lambda sig: math.log((1 - sig) / sig)  # noqa: E731
    h = lam(t) - lam(s)
    r0 = (lam(s) - lam(s_prev)) / h
    d0, d1 = m, (m - m_prev) / r0
    alpha_t = 1 - t
    return (t / s) * x - alpha_t * (math.exp(-h) - 1) * d0 - 0.5 * alpha_t * (math.exp(-h) - 1) * d1


def test_the_second_order_step_matches_mixgrpos_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x, m, m_prev = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ours = dpmpp_2m_step(x, m, 0.7, 0.55, m_prev, 0.8)
    assert torch.allclose(ours.double(), mixgrpo_2m(x, m, m_prev, 0.7, 0.55, 0.8), atol=1e-6)
    assert torch.equal(dpmpp_2m_step(x, m, 0.3, 0.0, m_prev, 0.4), m.float())  # the last step returns m
    with pytest.raises(ValueError, match="sigma > sigma_next"):
        dpmpp_2m_step(x, m, 0.3, 0.4)


# ---- the Flash schedule (C.6.2) -------------------------------------------------------------------


def mixgrpo_sigmas(n: int = 25) -> torch.Tensor:
    return torch.tensor([float(shift_sigmas(u, 3.0)) for u in np.linspace(1, 0, n + 1)], dtype=torch.float64)


@pytest.mark.parametrize(
    ("last", "ratio", "post"),
    [
        (3, 0.4, [0.9403, 0.8852, 0.8182, 0.7347, 0.6279, 0.4865, 0.2903, 0.0]),  # Flash
        (3, 0.2, [0.9403, 0.7925, 0.5385, 0.0]),  # Flash*
    ],
)
def test_the_flash_schedules_of_c6_2(last: int, ratio: float, post: list[float]) -> None:
    sigmas = mixgrpo_sigmas()
    timesteps = sigmas[:-1] * 1000
    new_sigmas, new_timesteps = compress_after(sigmas, timesteps, last, ratio)
    assert torch.equal(new_sigmas[: last + 1], sigmas[: last + 1])  # the window and before: untouched
    assert new_sigmas[last + 1 :].tolist() == pytest.approx(post, abs=5e-5)
    assert new_timesteps.shape[0] == new_sigmas.shape[0] - 1 == last + len(post)  # 11 and 7 steps in all
    assert torch.allclose(new_timesteps, new_sigmas[:-1] * 1000)


def test_the_last_window_still_ends_at_sigma_zero() -> None:
    """MixGRPO's n_post = 1 at window end 22 stops at sigma 0.2069; here n >= 2, so the schedule reaches 0."""
    sigmas = mixgrpo_sigmas()
    new_sigmas, _ = compress_after(sigmas, sigmas[:-1] * 1000, 22, 0.4)
    assert new_sigmas[23] == pytest.approx(0.2069, abs=5e-5) and float(new_sigmas[-1]) == 0.0
    assert post_window_points(25, 24, 0.4) == [25.0]  # a window at the last step leaves one point: sigma 0


def test_a_fractional_position_interpolates_between_grid_points() -> None:
    sigmas = torch.linspace(1, 0, 11, dtype=torch.float64)
    new_sigmas, new_timesteps = compress_after(sigmas, sigmas[:-1] * 1000, 1, 0.5)  # n = 4 points over 2..10
    assert post_window_points(10, 1, 0.5) == pytest.approx([2, 2 + 8 / 3, 2 + 16 / 3, 10])
    assert new_sigmas.tolist() == pytest.approx([1.0, 0.9, 0.8, 0.8 - 0.8 / 3, 0.8 - 1.6 / 3, 0.0])
    assert torch.allclose(new_timesteps, new_sigmas[:-1] * 1000)
