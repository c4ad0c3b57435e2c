"""DMD2 on rectified flow: conversions, generator and critic losses, GAN, TTUR (algorithms.md A.3-A.10, D.1-D.3)."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algorithms.dmd2 import (
    add_noise,
    cfg_combine,
    dm_gradient,
    dm_timesteps,
    dmd2_critic_loss,
    dmd2_generator_loss,
    eps_from_velocity,
    gan_discriminator_loss,
    gan_generator_loss,
    is_generator_step,
    score_from_velocity,
    x0_from_velocity,
)

D = torch.float64
LN2 = math.log(2)


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


# --- D.1 conversions --------------------------------------------------------------------------------


def test_rf_round_trip_and_score_identity():
    x0, eps = _t(4, 4, 8, 8, seed=0), _t(4, 4, 8, 8, seed=1)
    sigma = torch.tensor([0.05, 0.3, 0.7, 0.99], dtype=D)
    x_t = add_noise(x0, eps, sigma)
    v = eps - x0
    assert torch.allclose(x0_from_velocity(x_t, sigma, v), x0, atol=1e-12, rtol=0)
    assert torch.allclose(eps_from_velocity(x_t, sigma, v), eps, atol=1e-12, rtol=0)
    score = score_from_velocity(x_t, sigma, v)
    assert torch.allclose(score, -eps / sigma.view(-1, 1, 1, 1), atol=1e-10)
    # the DM direction: s_fake - s_real = (1 - sigma) / sigma**2 * (x0_fake - x0_real)
    v_real, v_fake = _t(4, 4, 8, 8, seed=2), _t(4, 4, 8, 8, seed=3)
    ds = score_from_velocity(x_t, sigma, v_fake) - score_from_velocity(x_t, sigma, v_real)
    dx0 = x0_from_velocity(x_t, sigma, v_fake) - x0_from_velocity(x_t, sigma, v_real)
    sv = sigma.view(-1, 1, 1, 1)
    assert torch.allclose(ds, (1 - sv) / sv**2 * dx0, atol=1e-9)


def test_cfg_identity_affinity_and_commutation_with_x0():
    v_u, v_c = _t(2, 4, 4, seed=0), _t(2, 4, 4, seed=1)
    assert cfg_combine(v_u, v_c, 1.0) is v_c
    assert cfg_combine(None, v_c, 1.0) is v_c
    for w in (0.0, 2.0, 8.0):
        assert torch.allclose(cfg_combine(v_u, v_c, w), (1 - w) * v_u + w * v_c, atol=1e-12)
    x_t, sigma, w = _t(2, 4, 4, seed=2), torch.tensor([0.3, 0.8], dtype=D), 4.5
    x0_u, x0_c = x0_from_velocity(x_t, sigma, v_u), x0_from_velocity(x_t, sigma, v_c)
    assert torch.allclose(x0_from_velocity(x_t, sigma, cfg_combine(v_u, v_c, w)), x0_u + w * (x0_c - x0_u), atol=1e-12)
    with pytest.raises(ValueError):
        cfg_combine(None, v_c, 2.0)


# --- D.2 generator loss -------------------------------------------------------------------------------


def test_zero_when_fake_equals_real():
    x = _t(3, 4, 8, 8, seed=0).requires_grad_(True)
    real = _t(3, 4, 8, 8, seed=1)
    loss, m = dmd2_generator_loss(x, real, real.clone())
    assert loss.item() == 0.0 and m["dm_grad_abs_mean"] == 0.0
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_autograd_equals_grad_over_numel():
    x = _t(3, 4, 8, 8, seed=0).requires_grad_(True)
    real, fake = _t(3, 4, 8, 8, seed=1), _t(3, 4, 8, 8, seed=2)
    loss, _ = dmd2_generator_loss(x, real, fake)
    loss.backward()
    g = dm_gradient(x, real, fake)
    norm = (x.detach() - real).abs().flatten(1).mean(1).view(-1, 1, 1, 1)
    assert torch.allclose(g, (fake - real) / norm, atol=1e-14)
    assert torch.allclose(x.grad, g / x.numel(), atol=1e-15, rtol=1e-12)
    assert loss.item() == pytest.approx(0.5 * (g**2).mean().item(), rel=1e-12)


def test_sign_step_moves_toward_real_and_normalization():
    x = _t(2, 4, 8, 8, seed=0).requires_grad_(True)
    delta = _t(2, 4, 8, 8, seed=1) * torch.tensor([1.0, 1e-3], dtype=D).view(-1, 1, 1, 1)
    real = x.detach() + delta
    fake = x.detach().clone()
    g = dm_gradient(x, real, fake)
    assert torch.allclose(g, -delta / delta.abs().flatten(1).mean(1).view(-1, 1, 1, 1), atol=1e-12)
    # D.2.4: |grad| has mean 1 per sample, whatever the scale of delta
    assert torch.allclose(g.abs().flatten(1).mean(1), torch.ones(2, dtype=D), atol=1e-12)
    loss, _ = dmd2_generator_loss(x, real, fake)
    loss.backward()
    before = (x.detach() - real).norm()
    after = (x.detach() - 10.0 * x.grad - real).norm()
    assert after < before


def test_invariance_to_a_common_scale():
    x = _t(2, 4, 8, 8, seed=0)
    real, fake = _t(2, 4, 8, 8, seed=1), _t(2, 4, 8, 8, seed=2)
    c = 7.5
    g1 = dm_gradient(x, real, fake)
    g2 = dm_gradient(x, x - c * (x - real), x - c * (x - fake))
    assert torch.allclose(g1, g2, atol=1e-12)


def test_nan_guard_when_generator_output_equals_real():
    x = _t(2, 4, 8, 8, seed=0).requires_grad_(True)
    real = x.detach().clone()
    fake = _t(2, 4, 8, 8, seed=1)
    fake[0] = real[0]  # 0 / 0 as well as c / 0 in the second sample
    loss, _ = dmd2_generator_loss(x, real, fake)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(dm_gradient(x, real, fake), torch.zeros_like(x))  # 0/0 and c/0 both give 0
    assert loss.item() == 0.0


def test_dm_timesteps_range_and_uniformity():
    t = dm_timesteps(100_000, 0.02, 0.98, torch.Generator().manual_seed(0))
    assert t.dtype == torch.float32
    steps = (t.double() * 1000).round().long()
    assert steps.min().item() == 20 and steps.max().item() == 980
    counts = torch.bincount(steps - 20, minlength=961).double()
    expected = 100_000 / 961
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 960 dof: mean 960, sd ~43.8; 6 sd is a comfortable margin for a fixed seed
    assert chi2 < 960 + 6 * math.sqrt(2 * 960)
    full = (dm_timesteps(50_000, 0.0, 1.0, torch.Generator().manual_seed(1)).double() * 1000).round()
    assert full.min().item() == 0 and full.max().item() == 999  # the critic's range
    shifted = dm_timesteps(1000, 0.02, 0.98, torch.Generator().manual_seed(0), shift=3.0)
    assert shifted.min().item() >= 0.02 - 1e-7 and shifted.max().item() <= 0.98 + 1e-7
    with pytest.raises(ValueError):
        dm_timesteps(1, 0.9, 0.1)


# --- D.3 critic, GAN, TTUR ------------------------------------------------------------------------------


def test_critic_loss_zero_at_the_exact_velocity_and_no_student_gradient():
    x0 = _t(3, 4, 8, 8, seed=0).requires_grad_(True)  # a student output with a graph
    eps = _t(3, 4, 8, 8, seed=1)
    loss, m = dmd2_critic_loss(eps - x0.detach(), eps, x0)
    assert loss.item() == 0.0 and m["loss"] == 0.0
    v_fake = _t(3, 4, 8, 8, seed=2).requires_grad_(True)
    loss, _ = dmd2_critic_loss(v_fake, eps, x0)
    loss.backward()
    assert x0.grad is None
    assert torch.allclose(v_fake.grad, 2 * (v_fake.detach() - (eps - x0.detach())) / v_fake.numel())


def test_gan_losses_at_zero_logits_and_gradient_signs():
    lf = torch.zeros(4, 1, dtype=D, requires_grad=True)
    lr = torch.zeros(4, 1, dtype=D)
    ld, md = gan_discriminator_loss(lf, lr)
    assert ld.item() == pytest.approx(2 * LN2) and md["loss_fake"] == pytest.approx(LN2)
    assert md["loss_real"] == pytest.approx(LN2)
    (gd,) = torch.autograd.grad(ld, lf)
    assert torch.allclose(gd, torch.full_like(lf, 0.5 / 4))  # sigmoid(l_f) / B > 0
    lg, mg = gan_generator_loss(lf)
    assert lg.item() == pytest.approx(LN2) and mg["loss"] == pytest.approx(LN2)
    (gg,) = torch.autograd.grad(lg, lf)
    assert torch.allclose(gg, torch.full_like(lf, -0.5 / 4))  # -sigmoid(-l_f) / B < 0


def test_ttur_schedule():
    gen_steps = [s for s in range(20) if is_generator_step(s, 5)]
    assert gen_steps == [0, 5, 10, 15]
    assert all(is_generator_step(s, 1) for s in range(5))
    with pytest.raises(ValueError):
        is_generator_step(0, 0)


# --- D.2.1 / D.2.8 / D.2.9 with networks: one generator turn on tiny MLPs ----------------------------------


class _VelocityNet(torch.nn.Module):
    """v(x, sigma, c): c = 1 conditional, 0 unconditional (the two differ, so CFG matters)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)).double()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: float) -> torch.Tensor:
        extra = torch.stack([sigma, torch.full_like(sigma, cond)], dim=1)
        return self.net(torch.cat([x, extra], dim=1))


def _generator_turn(generator, teacher, critic, w_real: float):
    """DMD2's generator turn: x0_gen with grad, the real/fake scores at a noised sg(x0_gen) without."""
    z = _t(4, 8, seed=5)
    x0_gen = generator(z)
    sigma = dm_timesteps(4, generator=torch.Generator().manual_seed(0)).double()
    x_t = add_noise(x0_gen.detach(), _t(4, 8, seed=6), sigma)
    with torch.no_grad():
        v_real = cfg_combine(teacher(x_t, sigma, 0.0), teacher(x_t, sigma, 1.0), w_real)
        v_fake = critic(x_t, sigma, 1.0)  # the fake score never uses CFG
    loss, _ = dmd2_generator_loss(x0_gen, x0_from_velocity(x_t, sigma, v_real), x0_from_velocity(x_t, sigma, v_fake))
    loss.backward()
    return loss


def test_critic_equal_to_teacher_at_guidance_1_gives_no_generator_gradient():
    import copy

    generator = torch.nn.Linear(8, 8).double()
    teacher = _VelocityNet(0).requires_grad_(False)
    critic = copy.deepcopy(teacher).requires_grad_(True)
    loss = _generator_turn(generator, teacher, critic, 1.0)
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in generator.parameters())
    # with the teacher's CFG at 4, the same critic no longer matches the real score
    generator.zero_grad()
    assert _generator_turn(generator, teacher, critic, 4.0).item() > 0


def test_a_generator_turn_leaves_no_gradient_on_critic_or_teacher():
    generator = torch.nn.Linear(8, 8).double()
    teacher, critic = _VelocityNet(0).requires_grad_(False), _VelocityNet(1)
    _generator_turn(generator, teacher, critic, 4.0)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in generator.parameters())
    assert all(p.grad is None for p in critic.parameters())
    assert all(p.grad is None for p in teacher.parameters())
