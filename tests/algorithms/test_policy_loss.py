"""Flow-GRPO policy loss and KL (algorithms.md B.5, D.5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from miles.algorithms.policy_loss import clamp_advantages, flow_grpo_kl, policy_loss
from miles.sampling.sde import sd3_sigmas, sde_step

EPS = 1e-4
SIGMAS = sd3_sigmas(10, shift=3.0).double()


def _step(v, x, i=3, prev_sample=None):
    return sde_step(
        v, x, SIGMAS[i], SIGMAS[i + 1], sde_type="sde", noise_level=0.7, sigma_max=SIGMAS[1], prev_sample=prev_sample
    )


def _ratio_loss(ratio: float, adv: float):
    """Loss and d loss / d log-ratio for one sample at a given ratio."""
    old = torch.tensor([-1.3], dtype=torch.float64)
    log_ratio = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(old + log_ratio, old, torch.tensor([adv], dtype=torch.float64), clip_range=EPS)
    loss.backward()
    return loss.item(), log_ratio.grad.item(), metrics


# --- D.5.1 on-policy value and gradient ---------------------------------------------------------


def test_on_policy_value_and_gradient_through_sde_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 4, 4, generator=g, dtype=torch.float64)
    u = torch.randn(4, 2, 4, 4, generator=g, dtype=torch.float64)
    theta = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        stored = _step(theta * u, x)  # the rollout: sample x' and its log-prob
    adv = torch.tensor([1.5, -0.5, 2.0, -3.0], dtype=torch.float64)

    new = _step(theta * u, x, prev_sample=stored.prev_sample)
    assert torch.allclose(new.log_prob, stored.log_prob.float(), atol=1e-5)
    loss, metrics = policy_loss(new.log_prob, new.log_prob.detach(), adv, clip_range=EPS)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-12)
    assert metrics["clipfrac"] == 0.0 and metrics["ratio_abs_minus_1"] == 0.0 and metrics["approx_kl"] == 0.0
    (grad,) = torch.autograd.grad(loss, theta)

    logp = _step(theta * u, x, prev_sample=stored.prev_sample).log_prob
    (expected,) = torch.autograd.grad(-(adv * logp).mean(), theta)
    assert grad.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_one_sgd_step_moves_log_prob_with_the_advantage_sign(adv):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 4, 4, generator=g, dtype=torch.float64)
    u = torch.randn(1, 3, 4, 4, generator=g, dtype=torch.float64)
    theta = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        stored = _step(theta * u, x)
    logp0 = _step(theta * u, x, prev_sample=stored.prev_sample).log_prob
    loss, _ = policy_loss(logp0, logp0.detach(), torch.tensor([adv], dtype=torch.float64), clip_range=EPS)
    loss.backward()
    with torch.no_grad():
        theta -= 1e-3 * theta.grad
        logp1 = _step(theta * u, x, prev_sample=stored.prev_sample).log_prob
    assert (logp1 - logp0.detach()).item() * adv > 0


# --- D.5.2 clipping -----------------------------------------------------------------------------


def test_clip_positive_advantage_above_range_is_clipped_with_zero_gradient():
    loss, grad, m = _ratio_loss(1 + 2 * EPS, 2.0)
    assert loss == pytest.approx(-2.0 * (1 + EPS), abs=1e-12)
    assert grad == 0.0
    assert m["clipfrac"] == 1.0 and m["clipfrac_gt_one"] == 1.0 and m["clipfrac_lt_one"] == 0.0


def test_clip_positive_advantage_below_range_is_unclipped():
    loss, grad, _ = _ratio_loss(1 - 2 * EPS, 2.0)
    assert loss == pytest.approx(-2.0 * (1 - 2 * EPS), abs=1e-12)
    assert grad == pytest.approx(-2.0 * (1 - 2 * EPS), rel=1e-9)  # d(-A * exp(l)) / dl


def test_clip_negative_advantage_below_range_is_clipped_with_zero_gradient():
    loss, grad, m = _ratio_loss(1 - 2 * EPS, -2.0)
    assert loss == pytest.approx(2.0 * (1 - EPS), abs=1e-12)
    assert grad == 0.0
    assert m["clipfrac_lt_one"] == 1.0


def test_clip_negative_advantage_above_range_is_unclipped():
    loss, grad, _ = _ratio_loss(1 + 2 * EPS, -2.0)
    assert loss == pytest.approx(2.0 * (1 + 2 * EPS), abs=1e-12)
    assert grad == pytest.approx(2.0 * (1 + 2 * EPS), rel=1e-9)


def test_clipfrac_counts_exactly_the_out_of_range_ratios():
    ratios = torch.tensor(
        [1.0, 1 + 0.5 * EPS, 1 + 2 * EPS, 1 - 2 * EPS, 1 - 0.5 * EPS, 1 + 5 * EPS], dtype=torch.float64
    )
    old = torch.zeros(6, dtype=torch.float64)
    _, m = policy_loss(old + ratios.log(), old, torch.ones(6, dtype=torch.float64), clip_range=EPS)
    assert m["clipfrac"] == pytest.approx(3 / 6)
    assert m["clipfrac_gt_one"] == pytest.approx(2 / 6)
    assert m["clipfrac_lt_one"] == pytest.approx(1 / 6)
    d = ratios.log()
    assert m["approx_kl"] == pytest.approx(0.5 * (d**2).mean().item())
    assert m["log_prob_mean_abs_diff"] == pytest.approx(d.abs().mean().item())
    assert m["ratio_abs_minus_1"] == pytest.approx((ratios - 1).abs().mean().item())


# --- D.5.3 advantage clamp ----------------------------------------------------------------------


def test_advantage_clamp():
    assert clamp_advantages(torch.tensor([7.0, -9.0, 3.0]), 5.0).tolist() == [5.0, -5.0, 3.0]
    zero = torch.zeros(1)
    loss, m = policy_loss(zero, zero, torch.tensor([7.0]), adv_clip_max=5.0)
    assert loss.item() == -5.0 and m["adv_abs_mean"] == 5.0
    loss, _ = policy_loss(zero, zero, torch.tensor([-9.0]), adv_clip_max=5.0)
    assert loss.item() == 5.0


def test_per_step_inputs_broadcast_a_per_sample_advantage():
    new = torch.zeros(2, 3)
    loss, _ = policy_loss(new, new, torch.tensor([1.0, 3.0]))
    assert loss.item() == pytest.approx(-2.0)


# --- D.5.4 / D.5.5 KL -----------------------------------------------------------------------------


def _kl_setup(scale=1.0, i=4):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    v_ref = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    dv = torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    ref = _step(v_ref, x, i=i)
    new = _step(v_ref + scale * dv, x, i=i, prev_sample=ref.prev_sample)
    return new, ref


def test_kl_zero_at_reference_nonnegative_and_quadratic():
    new, ref = _kl_setup(0.0)
    assert (flow_grpo_kl(new.mean, ref.mean, new.std_dev_t) == 0).all()
    new1, ref1 = _kl_setup(0.1)
    new2, _ = _kl_setup(0.2)
    kl1 = flow_grpo_kl(new1.mean, ref1.mean, new1.std_dev_t)
    kl2 = flow_grpo_kl(new2.mean, ref1.mean, new2.std_dev_t)
    assert (kl1 > 0).all()
    assert torch.allclose(kl2, 4 * kl1, rtol=1e-4)  # sde_step runs in fp32


@pytest.mark.parametrize("i", [0, 4, 8])
def test_code_kl_times_chw_over_dt_is_the_analytic_gaussian_kl(i):
    new, ref = _kl_setup(0.3, i=i)
    code_kl = flow_grpo_kl(new.mean, ref.mean, new.std_dev_t)
    dt = (SIGMAS[i] - SIGMAS[i + 1]).abs()
    chw = new.mean[0].numel()
    s = new.std  # std_dev_t * sqrt(|dt|)
    analytic = kl_divergence(Normal(new.mean, s), Normal(ref.mean, s)).flatten(1).sum(1)
    explicit = ((new.mean - ref.mean) ** 2).flatten(1).sum(1) / (2 * new.std_dev_t**2 * dt)
    assert torch.allclose(code_kl * chw / dt, analytic, rtol=1e-5)
    assert torch.allclose(code_kl * chw / dt, explicit, rtol=1e-5)


def test_loss_composition_with_kl():
    new, ref = _kl_setup(0.3)
    lp = new.log_prob
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    beta = 0.04
    loss, m = policy_loss(
        lp, lp.detach(), adv, kl_beta=beta, mean_new=new.mean, mean_ref=ref.mean, std_dev_t=new.std_dev_t
    )
    kl = flow_grpo_kl(new.mean, ref.mean, new.std_dev_t).mean()
    assert loss.item() == pytest.approx(m["policy_loss"] + beta * kl.item(), rel=1e-6)
    assert m["kl_loss"] == pytest.approx(kl.item(), rel=1e-6)
    assert m["loss"] == pytest.approx(loss.item())


def test_beta_zero_needs_no_reference_and_beta_positive_without_one_raises():
    lp = torch.zeros(2, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), torch.ones(2), kl_beta=0.0)
    assert m["kl_loss"] == 0.0
    loss.backward()

    mean_new = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="--ref-mode"):
        policy_loss(lp, lp.detach(), torch.ones(2), kl_beta=0.01, mean_new=mean_new, std_dev_t=torch.ones(2))


def test_beta_zero_with_a_reference_reports_kl_but_does_not_train_on_it():
    new, ref = _kl_setup(0.3)
    lp = new.log_prob
    loss, m = policy_loss(
        lp, lp.detach(), torch.ones(3), kl_beta=0.0, mean_new=new.mean, mean_ref=ref.mean, std_dev_t=new.std_dev_t
    )
    assert m["kl_loss"] > 0
    assert loss.item() == pytest.approx(m["policy_loss"])


def test_invalid_clip_range():
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="clip-range"):
        policy_loss(z, z, z, clip_range=0.0)
