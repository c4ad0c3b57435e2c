"""The shared SDE/CPS/ODE step math and the seed layout (algorithms.md D.4)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from miles.models.pipeline_config import scheduler_schedule
from miles.sampling.sde import (
    draw_noise,
    sd3_sigmas,
    sde_step,
    shift_sigmas,
    sigmas_to_timesteps,
    step_log_prob,
)
from miles.sampling.seeds import (
    expand_seed,
    group_sample_seeds,
    initial_noise,
    initial_noise_batch,
    microgroup_seed,
    seed_base,
)

SIGMAS = sd3_sigmas(10, shift=3.0)
SIGMA_MAX = SIGMAS[1]
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _inputs(batch=4, seed=0, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)


def _step(i, x, v, **kw):
    kw.setdefault("sde_type", "sde")
    kw.setdefault("noise_level", 0.7)
    return sde_step(v, x, SIGMAS[i], SIGMAS[i + 1], sigma_max=SIGMA_MAX, **kw)


# --- D.4.6 schedule -----------------------------------------------------------------------------


def test_schedule_values_and_diffusers_equality():
    expected = [1000, 960.13, 913.35, 857.69, 790.37, 707.28, 602.15, 464.88, 278.05, 8.93]
    timesteps = sigmas_to_timesteps(SIGMAS)
    assert SIGMAS.shape == (11,) and SIGMAS.dtype == torch.float32 and SIGMAS[-1] == 0
    assert torch.allclose(timesteps.double(), torch.tensor(expected, dtype=torch.float64), atol=0.01)
    # the double shift of sigma_min, by formula
    formula = shift_sigmas(torch.linspace(1, shift_sigmas(1e-3, 3.0), 10, dtype=torch.float64), 3.0) * 1000
    assert torch.allclose(formula, torch.tensor(expected, dtype=torch.float64), atol=0.01)

    for steps, shift in [(10, 3.0), (40, 3.0), (7, 1.0), (25, 5.5)]:
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
        sched.set_timesteps(steps)
        ref_sigmas, ref_timesteps = scheduler_schedule(sched)
        ours = sd3_sigmas(steps, shift=shift)
        assert torch.equal(ours, ref_sigmas), (steps, shift)
        assert torch.equal(sigmas_to_timesteps(ours), ref_timesteps), (steps, shift)


# --- D.4.1 closed form, D.4.2 guard -------------------------------------------------------------


@pytest.mark.parametrize("i", range(10))
def test_log_prob_matches_torch_normal(i):
    x, v = _inputs(seed=i)
    res = _step(i, x, v, generator=torch.Generator().manual_seed(100 + i))
    ref = torch.distributions.Normal(res.mean, res.std).log_prob(res.prev_sample).mean(dim=(1, 2, 3))
    assert res.log_prob.shape == (4,)
    assert torch.allclose(res.log_prob, ref, atol=1e-6, rtol=0)
    # the std is the documented one: std_dev_t * sqrt(-dt)
    dt = SIGMAS[i + 1] - SIGMAS[i]
    assert torch.allclose(res.std, res.std_dev_t * torch.sqrt(-dt), rtol=1e-6)
    # step_log_prob on its own gives the same numbers
    assert torch.equal(step_log_prob(res.prev_sample, res.mean, res.std, "sde"), res.log_prob)


def test_sigma_one_guard():
    x, v = _inputs()
    res = _step(0, x, v, generator=torch.Generator().manual_seed(0))
    assert SIGMAS[0] == 1.0
    assert res.std == torch.tensor(0.7, dtype=torch.float32)  # exactly a
    assert res.std_dev_t.item() == pytest.approx(3.50567, abs=1e-5)
    assert torch.isfinite(res.log_prob).all()
    # s = a at sigma = 1 for any schedule and noise level
    for sigmas, a in [(sd3_sigmas(40, 3.0), 0.8), (torch.linspace(1, 0, 11), 0.3)]:
        r = sde_step(v, x, sigmas[0], sigmas[1], sde_type="sde", noise_level=a, sigma_max=sigmas[1], noise=x)
        assert r.std == torch.tensor(a, dtype=torch.float32)
    # the table of algorithms.md B.2
    for i, s in [(1, 0.743), (4, 0.392), (8, 0.225), (9, 0.0063)]:
        assert _step(i, x, v, noise=x).std.item() == pytest.approx(s, abs=6e-4)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(v, x, 1.0, SIGMAS[1], sde_type="sde", noise_level=0.7, noise=x)


def test_the_guard_holds_on_a_grid_whose_first_sigma_misses_one():
    """UniPC's flow sigmas (cosmos3) start at 0.999999, not 1: Flow-GRPO's `sigma == 1` guard missed them and the
    first step's std was ~100 (the sample drowned in noise). The guard is the first step's (sigma > sigma_max), so
    there it gives a * sqrt(sigma * |dt| / (1 - sigmas[1])), about a; on a grid that starts at 1 nothing changes."""
    x, v = _inputs()
    first, second = 1.0 - 1.0133e-6, 0.9782845  # tiny-cosmos3's 10-step grid
    r = sde_step(v, x, first, second, sde_type="sde", noise_level=0.7, sigma_max=second, noise=x)
    expected = 0.7 * math.sqrt(first * (first - second) / (1 - second))
    assert r.std.item() == pytest.approx(expected, rel=1e-5) and 0.69 < r.std.item() < 0.71
    unguarded = 0.7 * math.sqrt(first * (first - second) / (1 - first))
    assert unguarded > 100  # what it was
    # steps below sigmas[1] are never guarded: step 1 of the same grid as before
    r1 = sde_step(v, x, second, 0.9524376, sde_type="sde", noise_level=0.7, sigma_max=second, noise=x)
    assert r1.std.item() == pytest.approx(0.7 * math.sqrt(second * (second - 0.9524376) / (1 - second)), rel=1e-5)


# --- D.4.3 ODE limit ----------------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 4, 9])
def test_ode_and_zero_noise_are_euler(i):
    x, v = _inputs()
    euler = x + v * (SIGMAS[i + 1] - SIGMAS[i])
    ode = _step(i, x, v, sde_type="ode")
    assert torch.equal(ode.prev_sample, euler) and ode.log_prob is None and ode.std == 0
    quiet = _step(i, x, v, noise_level=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quiet.prev_sample, euler) and quiet.log_prob is None
    cps = _step(i, x, v, sde_type="cps", noise_level=0.0)
    assert torch.allclose(cps.prev_sample, euler, atol=1e-6) and cps.log_prob is None


# --- D.4.4 self-consistency ---------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 4, 8])
def test_self_consistency(i):
    x, v = _inputs(batch=64, shape=(4, 16, 16))
    res = _step(i, x, v, generator=torch.Generator().manual_seed(7))
    s = res.std.double().item()
    expected = -0.5 - math.log(s) - LOG_SQRT_2PI
    assert res.log_prob.double().mean().item() == pytest.approx(expected, abs=5e-3)


# --- D.4.5 marginal preservation ----------------------------------------------------------------


def test_marginal_preservation_toy_gaussian():
    s2 = 0.25

    def velocity(x, t):  # exact velocity for data N(0, s2)
        return x * (t - (1 - t) * s2) / ((1 - t) ** 2 * s2 + t**2)

    def run(n):
        g = torch.Generator().manual_seed(0)
        sigmas = torch.linspace(1, 0, n + 1, dtype=torch.float64).float()
        x = torch.randn(20000, generator=g)
        mid = None
        for i in range(n):
            x = sde_step(
                velocity(x, sigmas[i]), x, sigmas[i], sigmas[i + 1],
                sde_type="sde", noise_level=0.7, sigma_max=sigmas[1], generator=g,
            ).prev_sample  # fmt: skip
            if 2 * (i + 1) == n:
                mid = x.var().item()
        return x.var().item(), mid

    var10, _ = run(10)
    var1000, mid1000 = run(1000)
    assert var10 == pytest.approx(0.229, abs=0.01)  # coarse steps do not preserve the marginal ...
    assert var1000 == pytest.approx(s2, abs=0.01)  # ... fine ones do
    assert mid1000 == pytest.approx(0.5**2 * s2 + 0.5**2, abs=0.01)  # (1-t)^2 s^2 + t^2 at t = 0.5


# --- D.4.7 CPS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 3, 9])
def test_cps(i):
    x, v = _inputs()
    sigma, sigma_next = SIGMAS[i], SIGMAS[i + 1]
    a = 0.8
    res = _step(i, x, v, sde_type="cps", noise_level=a, generator=torch.Generator().manual_seed(1))
    std = sigma_next * math.sin(a * math.pi / 2)
    assert torch.allclose(res.std, std, rtol=1e-6) and torch.equal(res.std_dev_t, res.std)
    coef_sq = sigma_next**2 - std**2
    assert torch.allclose(coef_sq + std**2, sigma_next**2, atol=1e-7)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0_hat + torch.sqrt(coef_sq.clamp(min=0)) * x1_hat
    assert torch.allclose(res.mean, mean, atol=1e-6)
    # no constants: the log-prob is -mean((x' - mean)^2), 0 at the mean
    assert torch.allclose(res.log_prob, -((res.prev_sample - res.mean) ** 2).mean(dim=(1, 2, 3)), atol=1e-7)
    at_mean = _step(i, x, v, sde_type="cps", noise_level=a, prev_sample=res.mean)
    assert torch.equal(at_mean.log_prob, torch.zeros(4))
    # a = 0 is the Euler step
    euler = x + v * (sigma_next - sigma)
    assert torch.allclose(_step(i, x, v, sde_type="cps", noise_level=0.0).prev_sample, euler, atol=1e-6)


# --- D.4.8 recompute ----------------------------------------------------------------------------


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_recompute_is_exact_across_batch_sizes(sde_type):
    x, v = _inputs(batch=6)
    for i in (0, 3, 8):
        rollout = _step(i, x, v, sde_type=sde_type, generator=torch.Generator().manual_seed(i))
        again = _step(i, x, v, sde_type=sde_type, prev_sample=rollout.prev_sample)
        assert torch.equal(again.log_prob, rollout.log_prob)
        assert torch.equal(torch.exp(again.log_prob - rollout.log_prob), torch.ones(6))
        for rows in (slice(0, 1), slice(2, 5)):
            part = _step(i, x[rows], v[rows], sde_type=sde_type, prev_sample=rollout.prev_sample[rows])
            assert torch.equal(part.log_prob, rollout.log_prob[rows])
        # the trainer's per-pair form: per-batch sigma tensors give the same numbers
        sig = SIGMAS[i].repeat(6)
        per_pair = sde_step(
            v, x, sig, SIGMAS[i + 1].repeat(6), sde_type=sde_type, noise_level=0.7,
            sigma_max=SIGMA_MAX.repeat(6), prev_sample=rollout.prev_sample,
        )  # fmt: skip
        assert per_pair.std.shape == (6,)
        assert torch.equal(per_pair.log_prob, rollout.log_prob)
        assert torch.equal(per_pair.mean, rollout.mean)


def test_mixed_steps_in_one_batch_and_gradients():
    x, v = _inputs(batch=3)
    idx = torch.tensor([0, 4, 8])
    v = v.clone().requires_grad_(True)
    g = [torch.Generator().manual_seed(k) for k in range(3)]
    mixed = sde_step(
        v, x, SIGMAS[idx], SIGMAS[idx + 1], sde_type="sde", noise_level=0.7, sigma_max=SIGMA_MAX, generator=g
    )
    for row, i in enumerate(idx.tolist()):
        one = _step(i, x[row : row + 1], v[row : row + 1].detach(), prev_sample=mixed.prev_sample[row : row + 1])
        assert torch.allclose(one.log_prob, mixed.log_prob[row : row + 1], atol=1e-6)
    # the log-prob is differentiable through the mean only (the sample is detached)
    mixed.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


def test_inputs_are_cast_to_fp32_and_noise_sources_agree():
    x, v = _inputs(batch=2)
    res16 = _step(3, x.half(), v.bfloat16(), noise=torch.zeros_like(x))
    assert res16.prev_sample.dtype == torch.float32 and res16.log_prob.dtype == torch.float32
    via_gen = _step(3, x, v, generator=torch.Generator().manual_seed(5))
    via_noise = _step(3, x, v, noise=torch.randn(x.shape, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(via_gen.prev_sample, via_noise.prev_sample)
    # per-row generators: a row's noise does not depend on its batch
    rows = draw_noise(x.shape, [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert torch.equal(rows[1], draw_noise(x.shape[1:], torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="sde_type"):
        _step(3, x, v, sde_type="ddim")


# --- seeds --------------------------------------------------------------------------------------


def test_seed_layout_distinct_and_reproducible():
    rollout_seed, n, m, rollout_batch_size, rollouts = 42, 16, 8, 32, 5
    seen: dict[int, tuple[int, int, int]] = {}
    for rollout in range(rollouts):
        for g in range(rollout_batch_size):
            group_index = rollout * rollout_batch_size + g  # monotonic over the run
            seeds = group_sample_seeds(rollout_seed, group_index, n, microgroup_size=m)
            assert seeds == group_sample_seeds(rollout_seed, group_index, n, microgroup_size=m)
            assert seeds == group_sample_seeds(rollout_seed, group_index, n, microgroup_size=5)
            assert seeds[:m] == expand_seed(microgroup_seed(rollout_seed, group_index, n, 0), m)
            assert seeds[m:] == expand_seed(microgroup_seed(rollout_seed, group_index, n, m), m)
            for j, s in enumerate(seeds):
                assert s not in seen, (s, seen.get(s), (rollout, g, j))
                seen[s] = (rollout, g, j)
    assert len(seen) == rollouts * rollout_batch_size * n
    assert seed_base(42, 3, 16) == 42 + 48
    assert seed_base(2**31 - 1, 1, 1) == 0
    assert group_sample_seeds(7, 2, 4) == [15, 16, 17, 18]


def test_initial_noise_matches_plain_cpu_generator():
    shape = (4, 8, 8)
    noise = initial_noise(123, shape)
    assert torch.equal(noise, torch.randn(shape, generator=torch.Generator("cpu").manual_seed(123)))
    assert torch.equal(noise, initial_noise(123, shape))
    assert not torch.equal(noise, initial_noise(124, shape))
    assert torch.equal(initial_noise(123, (1, *shape))[0], noise)
    half = initial_noise(9, shape, dtype=torch.float16)
    ref = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(9), dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, ref)
    batch = initial_noise_batch([123, 7], shape)
    assert batch.shape == (2, *shape) and torch.equal(batch[0], noise)
