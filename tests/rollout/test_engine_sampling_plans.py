"""The diffusers engine's sampling plans on tiny-sd3: a shared prefix that branches at the SDE window
(Flow-GRPO-Fast, MixGRPO), DPM-Solver++ 2M and the compressed schedule after the window (MixGRPO-Flash), the
behaviour means GRPO-Guard reads, and the denoiser calls each costs (counted by the engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.ode_solvers import compress_after, data_prediction, dpmpp_2m_step
from miles.sampling.sde import sde_step

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir: Path) -> DiffusersEngine:
    args = resolve(
        "rl", recipe="tiny-digits-grpo", cli={"hf_checkpoint": str(tiny_sd3_dir), "diffusion_num_sde_steps": 2}
    ).args
    return DiffusersEngine(args, device="cpu")


def request(sde_steps: list[list[int]], seeds: list[int], **kw) -> GenerateRequest:
    return GenerateRequest(
        prompt="a handwritten digit 3",
        metadata={"label": 3},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=seeds,
        sde_steps=sde_steps,
        num_steps=STEPS,
        guidance_scale=4.0,
        noise_level=0.7,
        sde_type="sde",
        height=64,
        width=64,
        negative_prompt=" ",
        debug=True,  # the engine's velocity of every step, to replay its arithmetic here
        **kw,
    )


def recorded_sde_step(t, i: int, prev_sample: torch.Tensor | None = None):
    """The Flow-SDE step i of the trajectory `t` from its recorded velocity (the request's noise level 0.7)."""
    v = t.debug_model_outputs[i : i + 1]
    kw = {"sde_type": "sde", "noise_level": 0.7, "sigma_max": t.sigmas[1], "prev_sample": prev_sample}
    return sde_step(v, t.latents[i : i + 1], t.sigmas[i], t.sigmas[i + 1], **kw)


def replay_step(engine: DiffusersEngine, sample, i: int, x: torch.Tensor) -> torch.Tensor:
    """The engine's transition i of `sample` recomputed from its recorded velocity (ODE, or the recorded SDE
    sample's own next latent)."""
    t = sample.trajectory
    v = t.debug_model_outputs[i : i + 1]
    return sde_step(v, x, t.sigmas[i], t.sigmas[i + 1], sde_type="ode", noise_level=0.0).prev_sample


def test_a_shared_prefix_branches_at_the_window_and_costs_r_plus_m_times_t_minus_r(engine) -> None:
    m, window = 4, [3, 4]
    samples = engine.generate([request([window] * m, [50, 51, 52, 53], shared_prefix=True)])
    lat = torch.stack([s.trajectory.latents for s in samples])  # [m, T+1, ...]
    for i in range(window[0] + 1):  # x_0 .. x_3: one noise, one prefix
        assert all(torch.equal(lat[b, i], lat[0, i]) for b in range(m))
    assert all(not torch.equal(lat[b, window[0] + 1], lat[0, window[0] + 1]) for b in range(1, m))  # branched
    r = window[0]
    assert sum(s.denoiser_calls for s in samples) == pytest.approx(r + m * (STEPS - r))  # 3 + 4 * 5 = 23 < 32
    # the prefix's noise is the first sample's own initial noise (the same seed without a shared prefix)
    alone = engine.generate([request([window], [50])])[0]
    assert torch.equal(alone.trajectory.latents[: r + 1], lat[0, : r + 1])
    # each branch's window transitions have their own noise, with consistent recorded log-probs
    for s in samples:
        t = s.trajectory
        assert t.sde_step_indices == window
        for slot, i in enumerate(window):
            res = recorded_sde_step(t, i, prev_sample=t.latents[i + 1 : i + 2])
            assert float(res.log_prob) == pytest.approx(float(t.log_probs[slot]), abs=1e-5)


def test_without_a_shared_prefix_every_sample_has_its_own_noise(engine) -> None:
    samples = engine.generate([request([[3, 4]] * 2, [50, 51])])
    assert not torch.equal(samples[0].trajectory.latents[0], samples[1].trajectory.latents[0])
    assert sum(s.denoiser_calls for s in samples) == 2 * STEPS


def test_dpm_solver_after_the_window_and_the_compressed_schedule(engine) -> None:
    window, ratio = [1, 2], 0.5
    samples = engine.generate(
        [request([window] * 2, [60, 61], ode_solver="dpmpp_2m", post_sde_steps_ratio=ratio, shared_prefix=True)]
    )
    plain = engine.generate([request([window], [60])])[0]
    expected_sigmas, _ = compress_after(plain.trajectory.sigmas, plain.trajectory.timesteps, window[-1], ratio)
    n_steps = expected_sigmas.shape[0] - 1  # 3 + max(int(6 * 0.5), 2) - 1 = 5 of 8
    for s in samples:
        t = s.trajectory
        assert torch.equal(t.sigmas, expected_sigmas) and t.timesteps.shape[0] == n_steps == 5
        assert float(t.sigmas[-1]) == 0.0 and t.latents.shape[0] == n_steps + 1
        # replay: Euler before the window, the recorded SDE transitions, DPM-Solver++ 2M after it
        x = t.latents[0:1]
        prev = None
        for i in range(n_steps):
            v = t.debug_model_outputs[i : i + 1]
            pred = data_prediction(x, v, float(t.sigmas[i]))
            if i in window:
                nxt = t.latents[i + 1 : i + 2]
            elif i > window[-1]:
                nxt = dpmpp_2m_step(x, pred, float(t.sigmas[i]), float(t.sigmas[i + 1]), *prev)
            else:
                nxt = replay_step(engine, s, i, x)
            assert torch.allclose(nxt, t.latents[i + 1 : i + 2], atol=1e-5), i
            prev, x = (pred, float(t.sigmas[i])), nxt
    assert sum(s.denoiser_calls for s in samples) == pytest.approx(1 + 2 * (n_steps - 1))
    # the first step after the window is second order: it differs from the Euler step
    t = samples[0].trajectory
    euler = replay_step(engine, samples[0], 3, t.latents[3:4])
    assert not torch.allclose(euler, t.latents[4:5], atol=1e-6)


def test_the_behaviour_means_are_recorded_for_grpo_guard(engine) -> None:
    window = [0, 2, 5]
    sample = engine.generate([request([window], [70], record_means=True)])[0]
    t = sample.trajectory
    assert t.sde_means is not None and t.sde_means.shape == (3, *t.latents.shape[1:])
    for slot, i in enumerate(window):
        assert torch.allclose(recorded_sde_step(t, i).mean[0], t.sde_means[slot], atol=1e-6)
    assert engine.generate([request([window], [70])])[0].trajectory.sde_means is None  # only when asked


def test_samples_with_different_windows_cannot_share_a_prefix(engine) -> None:
    with pytest.raises(ValueError, match="must share their SDE steps"):
        engine.generate([request([[1, 2], [3, 4]], [80, 81], shared_prefix=True)])
