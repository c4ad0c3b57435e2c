"""GRPO-Guard: RatioNorm and the 1/|dt| step weight (algorithms_next.md A.2, A.6), against the note's numbers and
against the peers' formula written out here on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algorithms.grpo_guard import ratio_bias, ratio_norm_log_ratio, step_weight
from miles.algorithms.policy_loss import policy_loss
from miles.sampling.sde import sd3_sigmas, sde_step

LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, s: float) -> torch.Tensor:
    """Flow-SDE's log-prob, averaged over the elements (float64, written out for the test)."""
    return (-((x_next - mean) ** 2) / (2 * s**2) - math.log(s) - LOG_SQRT_2PI).mean(dim=1)


def test_the_identity_of_a6_1_log_ratio_hat_is_mean_xi_dmu() -> None:
    s = 0.5
    xi = torch.tensor([[1.0, -1.0, 0.5, 2.0]], dtype=torch.float64)
    dmu = torch.tensor([[0.01, 0.02, -0.01, 0.0]], dtype=torch.float64)
    mean_old = torch.zeros_like(xi)
    x_next = mean_old + s * xi
    l_old = gaussian_log_prob(x_next, mean_old, s)
    l_new = gaussian_log_prob(x_next, mean_old + dmu, s)
    assert float(l_new - l_old) == pytest.approx(-0.0078, abs=1e-12)
    assert math.exp(float(l_new - l_old)) == pytest.approx(0.992230, abs=1e-6)
    assert float(ratio_bias(mean_old + dmu, mean_old, s)) == pytest.approx(0.0003, abs=1e-15)
    hat = ratio_norm_log_ratio(l_new, l_old, mean_old + dmu, mean_old, s)
    assert float(hat) == pytest.approx(-0.00375, abs=1e-12)
    assert float(hat) == pytest.approx(float((xi * dmu).mean()), abs=1e-15)
    # Flow-Factory's form: s * (l_new - l_old) + mean_D(dmu**2) / (2 s)
    assert float(hat) == pytest.approx(float(s * (l_new - l_old) + (dmu**2).mean() / (2 * s)), abs=1e-15)


# The note's table A.6.2: SD3.5's 10-step schedule at noise level 0.7, per unit xi * grad v.
A62 = {  # j: (vanilla c|dt|/s, guard c)
    0: (0.0570, 1.000),
    1: (0.0784, 1.245),
    4: (0.2640, 1.245),
    7: (0.8248, 1.245),
    8: (1.4867, 1.245),
}


@pytest.mark.parametrize("j", sorted(A62))
def test_the_per_step_gradient_weights_of_a6_2(j: int) -> None:
    """On-policy, d(log rho)/dv = c dt xi / (D s) (vanilla) and, guarded, s * that / |dt| = -c xi / D: the weight
    of step j goes from c|dt|/s to the flat c."""
    sigmas = sd3_sigmas(10, shift=3.0).double()
    d = 64
    g = torch.Generator().manual_seed(j)
    x = torch.randn(1, d, generator=g, dtype=torch.float64)
    xi = torch.randn(1, d, generator=g, dtype=torch.float64)
    v_old = torch.randn(1, d, generator=g, dtype=torch.float64)
    kw = {"sde_type": "sde", "noise_level": 0.7, "sigma_max": sigmas[1]}
    behaviour = sde_step(v_old, x, sigmas[j], sigmas[j + 1], noise=xi, **kw)
    v = v_old.clone().requires_grad_(True)
    new = sde_step(v, x, sigmas[j], sigmas[j + 1], prev_sample=behaviour.prev_sample, **kw)
    # vanilla
    (g_vanilla,) = torch.autograd.grad(new.log_prob.sum(), v, retain_graph=True)
    # guarded, weighted
    hat = ratio_norm_log_ratio(new.log_prob, behaviour.log_prob, new.mean, behaviour.mean, new.std)
    w = step_weight(sigmas[j], sigmas[j + 1], hat)
    (g_guard,) = torch.autograd.grad((w * hat).sum(), v)
    vanilla_weight = float((g_vanilla * d / xi).abs().mean())
    guard_weight = float((g_guard * d / xi).abs().mean())
    expected_vanilla, expected_guard = A62[j]
    assert vanilla_weight == pytest.approx(expected_vanilla, abs=6e-5)
    assert guard_weight == pytest.approx(expected_guard, abs=6e-4)
    assert float(w * hat.detach()) == pytest.approx(0.0, abs=1e-6)  # on-policy: no bias, no ratio


@pytest.mark.slow  # over a second: not in the fast tier
def test_the_left_shift_of_a6_3_is_removed() -> None:
    """Monte Carlo: D = 4096, s = 0.1, |dmu| = 0.01: vanilla E[log rho] = -0.005, guarded mean 0 with std
    0.01 / sqrt(4096) = 1.5625e-4 (2,000 draws here; the note used 20,000)."""
    d, s, n = 4096, 0.1, 2000
    g = torch.Generator().manual_seed(0)
    xi = torch.randn(n, d, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, d, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    dmu = 0.01 * sign
    mean_old = torch.zeros(n, d, dtype=torch.float64)
    x_next = mean_old + s * xi
    vanilla = gaussian_log_prob(x_next, dmu, s) - gaussian_log_prob(x_next, mean_old, s)
    l_new, l_old = gaussian_log_prob(x_next, dmu, s), gaussian_log_prob(x_next, mean_old, s)
    hat = ratio_norm_log_ratio(l_new, l_old, dmu, mean_old, s)
    assert float(vanilla.mean()) == pytest.approx(-0.005, abs=3e-4)
    assert float(hat.mean()) == pytest.approx(0.0, abs=2e-5)
    assert float(hat.std()) == pytest.approx(1.5625e-4, rel=0.05)


def peer_guard_loss(log_new, log_old, mean_new, mean_old, std_dev_t, sqrt_dt, adv, clip, adv_max):
    """flow_grpo's GRPO-Guard branch as the note states it (A.2, A.4): s from batch means of std_dev_t and
    sqrt|dt|, the ratio exp(s (dl + b)), the clipped loss divided by sqrt_dt.mean()**2."""
    s = std_dev_t.mean() * sqrt_dt.mean()
    b = ((mean_new - mean_old) ** 2).mean(dim=tuple(range(1, mean_new.ndim))) / (2 * s**2)
    ratio = torch.exp((log_new - log_old + b) * s)
    a = torch.clamp(adv, -adv_max, adv_max)
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1 - clip, 1 + clip)
    return torch.maximum(unclipped, clipped).mean() / sqrt_dt.mean() ** 2


@pytest.mark.parametrize("j", [0, 3, 7])
def test_policy_loss_with_the_guard_matches_the_peers_formula(j: int) -> None:
    sigmas = sd3_sigmas(10, shift=3.0)
    g = torch.Generator().manual_seed(10 + j)
    b = 6
    x = torch.randn(b, 2, 4, 4, generator=g)
    v_old = torch.randn(b, 2, 4, 4, generator=g)
    kw = {"sde_type": "sde", "noise_level": 0.7, "sigma_max": sigmas[1]}
    behaviour = sde_step(v_old, x, sigmas[j], sigmas[j + 1], generator=g, **kw)
    drift = torch.tensor([0.0, 1e-6, 1e-5, 1e-3, 0.05, 0.1]).view(b, 1, 1, 1)  # on-policy to far off
    v = (v_old + drift * torch.randn(b, 2, 4, 4, generator=g)).requires_grad_(True)
    new = sde_step(v, x, sigmas[j], sigmas[j + 1], prev_sample=behaviour.prev_sample, **kw)
    adv = torch.tensor([1.5, -0.5, 2.0, -3.0, 7.0, 0.2])
    sig, sig_next = sigmas[j].expand(b), sigmas[j + 1].expand(b)
    hat = ratio_norm_log_ratio(new.log_prob, behaviour.log_prob, new.mean, behaviour.mean, new.std)
    clip = 2e-6
    ours, metrics = policy_loss(
        new.log_prob,
        behaviour.log_prob,
        adv,
        clip_range=clip,
        log_ratio=hat,
        weight=step_weight(sig, sig_next, hat),
    )
    sqrt_dt = torch.sqrt(sig - sig_next)
    peer = peer_guard_loss(
        new.log_prob, behaviour.log_prob, new.mean, behaviour.mean, new.std_dev_t.expand(b), sqrt_dt, adv, clip, 5.0
    )
    assert float(ours.detach()) == pytest.approx(float(peer.detach()), rel=1e-6, abs=1e-9)
    (g_ours,) = torch.autograd.grad(ours, v, retain_graph=True)
    (g_peer,) = torch.autograd.grad(peer, v)
    assert torch.allclose(g_ours, g_peer, rtol=1e-5, atol=1e-9)
    assert 0.0 < metrics["clipfrac"] < 1.0  # the tiny clip range binds on some rows and not others


def test_guard_inputs_are_checked() -> None:
    zero = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="positive step std"):
        ratio_bias(zero, zero, 0.0)
    with pytest.raises(ValueError, match="sigma_next != sigma"):
        step_weight(0.5, 0.5, torch.zeros(2))
    with pytest.raises(ValueError, match="log_ratio"):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), log_ratio=torch.zeros(3))
