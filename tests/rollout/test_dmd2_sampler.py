"""The DMD2 few-step sampler and backward simulation with a counting stub student (algorithms.md D.3.5-D.3.7)."""

from __future__ import annotations

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.dmd2.sampler import backward_simulate, few_step_sample, stop_step, student_sigmas, x0_at

STEPS = [999, 749, 499, 249]


class CountingStudent:
    """v(x, t) = 0.1 * x + t / 1000, recording the timestep of every call."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert t.shape == (x.shape[0],) and bool((t == t[0]).all())
        self.calls.append(float(t[0]))
        return 0.1 * x + t.view(-1, 1, 1, 1) / 1000


def _noise_fn(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda shape: torch.randn(shape, generator=gen)


def test_step_list_is_dmd2s_and_the_flag_default() -> None:
    assert list(range(999, 0, -250)) == STEPS
    assert list(range(999, 0, -500)) == [999, 499]  # 2 steps
    args = resolve("dmd2", recipe="tiny-digits-4step").args
    assert list(args.dmd2_student_timesteps) == STEPS
    assert student_sigmas(STEPS).tolist() == pytest.approx([0.999, 0.749, 0.499, 0.249])
    for bad in ([], [999, 999], [249, 999], [1000]):
        with pytest.raises(ValueError):
            student_sigmas(bad)


def test_stop_at_zero_is_the_pure_noise_input_with_no_call() -> None:
    student, noise = CountingStudent(), torch.randn(3, 4, 8, 8)
    sim = backward_simulate(student, noise, STEPS, 0, _noise_fn(0))
    assert student.calls == [] and torch.equal(sim.x_t, noise)
    assert (sim.step, sim.timestep, sim.sigma) == (0, 999, pytest.approx(0.999))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_stop_at_k_calls_the_student_k_times_at_the_first_k_timesteps(k: int) -> None:
    student, noise = CountingStudent(), torch.randn(3, 4, 8, 8)
    sim = backward_simulate(student, noise, STEPS, k, _noise_fn(1))
    assert student.calls == [float(t) for t in STEPS[:k]]
    assert sim.timestep == STEPS[k] and len(sim.states) == k + 1
    # each state is the previous x0 re-noised with fresh noise at the next sigma
    fresh = _noise_fn(1)
    x = noise
    for j in range(k):
        sigma, nxt = STEPS[j] / 1000, STEPS[j + 1] / 1000
        x0 = x - sigma * (0.1 * x + STEPS[j] / 1000)
        x = (1 - nxt) * x0 + nxt * fresh(x.shape)
        assert torch.allclose(sim.states[j + 1], x, atol=1e-6)
    with pytest.raises(ValueError):
        backward_simulate(student, noise, STEPS, len(STEPS), _noise_fn(1))


def test_the_inference_sampler_reproduces_the_backward_simulation_trajectory() -> None:
    noise = torch.randn(2, 4, 8, 8)
    student = CountingStudent()
    out = few_step_sample(student, noise, STEPS, _noise_fn(7))
    assert student.calls == [float(t) for t in STEPS]  # n calls
    sim = backward_simulate(CountingStudent(), noise, STEPS, len(STEPS) - 1, _noise_fn(7))
    assert torch.equal(out, x0_at(CountingStudent(), sim.x_t, sim.timestep))


def test_stop_step_is_shared_by_every_rank_and_uniform() -> None:
    draws = [stop_step(1234, it, 4) for it in range(4000)]
    assert draws[:50] == [stop_step(1234, it, 4) for it in range(50)]  # a pure function of (seed, iteration)
    counts = [draws.count(k) for k in range(4)]
    assert min(counts) > 900 and set(draws) == {0, 1, 2, 3}
    assert draws != [stop_step(99, it, 4) for it in range(4000)]
    assert {stop_step(1234, it, 4, backward_simulation=False) for it in range(100)} == {0}
