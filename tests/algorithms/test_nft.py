"""DiffusionNFT loss, optimality mapping and timestep selection (algorithms.md C.2, C.3, D.8)."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms.nft import nft_corrupt, nft_loss, nft_optimality, nft_timesteps
from miles.sampling.sde import sd3_sigmas

C = 5.0
D = torch.float64


def _data(batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 4, 8, 8, generator=g, dtype=D)
    noise = torch.randn(batch, 4, 8, 8, generator=g, dtype=D)
    t = torch.rand(batch, generator=g, dtype=D) * 0.9 + 0.05
    return x0, noise, t, nft_corrupt(x0, t, noise)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Conv2d(4, 4, 1).to(D)


def _fm_adaptive(x0, x_t, t, v):
    """The plain adaptive-weighted x0-space flow-matching loss, per sample."""
    err = x_t - t.view(-1, 1, 1, 1) * v - x0
    w = err.detach().abs().flatten(1).mean(1).clamp_min(1e-5)
    return (err**2).flatten(1).mean(1) / w


# --- D.8.1 r mapping ----------------------------------------------------------------------------


def test_optimality_mapping():
    a = torch.tensor([0.0, 5.0, -5.0, 2.5, 7.0, -9.0, -2.5])
    assert nft_optimality(a, 5.0).tolist() == [0.5, 1.0, 0.0, 0.75, 1.0, 0.0, 0.25]
    assert nft_optimality(torch.tensor([1.0]), 2.0).item() == 0.75  # c is also the slope
    with pytest.raises(ValueError):
        nft_optimality(a, 0.0)


# --- D.8.4 x0 identity --------------------------------------------------------------------------


def test_corruption_and_x0_identity():
    x0, noise, t, x_t = _data()
    tv = t.view(-1, 1, 1, 1)
    assert torch.allclose(x_t, (1 - tv) * x0 + tv * noise, atol=0)
    v = torch.randn_like(x0)
    lhs = ((x_t - tv * v - x0) ** 2).flatten(1).mean(1)
    rhs = tv.flatten() ** 2 * ((v - (noise - x0)) ** 2).flatten(1).mean(1)
    assert torch.allclose(lhs, rhs, rtol=1e-12, atol=1e-12)


# --- D.8.2 zero gradient at r = 0.5 when theta = theta_old ---------------------------------------


@pytest.mark.parametrize("beta", [1.0, 0.1])
@pytest.mark.parametrize("adaptive", [True, False])
def test_zero_policy_gradient_at_half_when_new_equals_old(beta, adaptive):
    x0, _, t, x_t = _data()
    model = _model()
    v_new = model(x_t)
    loss, m = nft_loss(
        x0, x_t, t, v_new, v_new.detach(), torch.zeros(4, dtype=D), beta=beta, adv_clip_max=C, adaptive_weight=adaptive
    )
    assert m["r_mean"] == 0.5
    assert m["positive_loss"] == pytest.approx(m["negative_loss"], rel=1e-12)
    loss.backward()
    for p in model.parameters():
        assert p.grad.abs().max().item() < 1e-12
    # the same with a bare velocity leaf
    v = v_new.detach().clone().requires_grad_(True)
    loss, _ = nft_loss(x0, x_t, t, v, v.detach(), torch.zeros(4, dtype=D), beta=beta, adaptive_weight=adaptive)
    (g,) = torch.autograd.grad(loss, v)
    assert g.abs().max().item() < 1e-12


# --- D.8.3 direction ------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_r_one_gradient_is_c_times_the_adaptive_flow_matching_gradient(beta):
    x0, _, t, x_t = _data()
    model = _model()
    v = model(x_t)
    loss, _ = nft_loss(x0, x_t, t, v, v.detach(), torch.full((4,), C, dtype=D), beta=beta, adv_clip_max=C)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    v = model(x_t)
    expected = torch.autograd.grad(C * _fm_adaptive(x0, x_t, t, v).mean(), list(model.parameters()))
    for a, b in zip(grads, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize(("adv", "sign"), [(C, -1), (-C, +1)])
def test_one_step_reduces_fm_loss_for_positive_and_increases_for_negative(adv, sign):
    x0, _, t, x_t = _data()
    model = _model()
    with torch.no_grad():
        before = _fm_adaptive(x0, x_t, t, model(x_t)).mean().item()
    v = model(x_t)
    loss, _ = nft_loss(x0, x_t, t, v, v.detach(), torch.full((4,), adv, dtype=D), beta=1.0)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-3 * p.grad
        after = _fm_adaptive(x0, x_t, t, model(x_t)).mean().item()
    assert (after - before) * sign > 0


# --- positive / negative halves (exact values) ---------------------------------------------------


@pytest.mark.parametrize("adaptive", [True, False])
def test_positive_and_negative_halves_values(adaptive):
    x0, _, t, x_t = _data()
    g = torch.Generator().manual_seed(5)
    v_new = torch.randn(x0.shape, generator=g, dtype=D)
    v_old = torch.randn(x0.shape, generator=g, dtype=D)
    beta = 0.5
    tv = t.view(-1, 1, 1, 1)

    def half(v):
        err = x_t - tv * v - x0
        sq = (err**2).flatten(1).mean(1)
        return sq / err.abs().flatten(1).mean(1).clamp_min(1e-5) if adaptive else sq

    l_pos = half(beta * v_new + (1 - beta) * v_old)
    l_neg = half((1 + beta) * v_old - beta * v_new)
    adv = torch.tensor([C, -C, 0.0, 2.5], dtype=D)
    r = torch.tensor([1.0, 0.0, 0.5, 0.75], dtype=D)
    loss, m = nft_loss(x0, x_t, t, v_new, v_old, adv, beta=beta, adv_clip_max=C, adaptive_weight=adaptive)
    expected = ((r * l_pos / beta + (1 - r) * l_neg / beta) * C).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert m["positive_loss"] == pytest.approx(l_pos.mean().item(), rel=1e-12)
    assert m["negative_loss"] == pytest.approx(l_neg.mean().item(), rel=1e-12)
    # r = 1 keeps only the positive half, r = 0 only the negative half
    loss1, _ = nft_loss(x0[:1], x_t[:1], t[:1], v_new[:1], v_old[:1], adv[:1], beta=beta, adaptive_weight=adaptive)
    assert loss1.item() == pytest.approx(C * l_pos[0].item() / beta, rel=1e-12)
    loss0, _ = nft_loss(
        x0[1:2], x_t[1:2], t[1:2], v_new[1:2], v_old[1:2], adv[1:2], beta=beta, adaptive_weight=adaptive
    )
    assert loss0.item() == pytest.approx(C * l_neg[1].item() / beta, rel=1e-12)


def test_adaptive_weight_floor_keeps_the_loss_finite():
    x0, noise, t, x_t = _data(batch=2)
    v_exact = noise - x0  # x0_hat == x0 exactly: the weight would be 0 without the floor
    loss, _ = nft_loss(x0, x_t, t, v_exact, v_exact, torch.zeros(2, dtype=D))
    assert torch.isfinite(loss) and loss.item() < 1e-10


# --- D.8.6 KL -------------------------------------------------------------------------------------


def test_kl_zero_at_reference_and_composition():
    x0, _, t, x_t = _data()
    g = torch.Generator().manual_seed(3)
    v_new = torch.randn(x0.shape, generator=g, dtype=D)
    v_old = torch.randn(x0.shape, generator=g, dtype=D)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=D)
    _, m0 = nft_loss(x0, x_t, t, v_new, v_old, adv, v_ref=v_new.clone(), kl_beta=1e-4)
    assert m0["kl_loss"] == 0.0
    v_ref = v_new + 0.1 * torch.randn(x0.shape, generator=g, dtype=D)
    loss, m = nft_loss(x0, x_t, t, v_new, v_old, adv, v_ref=v_ref, kl_beta=1e-4)
    kl = ((v_new - v_ref) ** 2).flatten(1).mean(1).mean().item()
    assert m["kl_loss"] == pytest.approx(kl, rel=1e-12)
    assert loss.item() == pytest.approx(m["policy_loss"] + 1e-4 * kl, rel=1e-12)
    with pytest.raises(ValueError, match="--ref-mode"):
        nft_loss(x0, x_t, t, v_new, v_old, adv, kl_beta=1e-4)


def test_invalid_beta():
    x0, _, t, x_t = _data(batch=1)
    with pytest.raises(ValueError, match="nft-beta"):
        nft_loss(x0, x_t, t, x0, x0, torch.zeros(1, dtype=D), beta=0.0)


# --- D.8.7 timesteps ------------------------------------------------------------------------------


def test_timesteps_permuted_per_sample():
    sigmas = sd3_sigmas(10, shift=3.0)
    schedule = set(sigmas[:-1].tolist())
    out = nft_timesteps(sigmas, 0.99, True, torch.Generator().manual_seed(0), batch=64)
    assert out.shape == (64, 9) and out.dtype == sigmas.dtype
    for row in out.tolist():
        assert len(set(row)) == 9 and set(row) <= schedule
    assert len({tuple(r) for r in out.tolist()}) > 32  # independent permutations
    dropped = {next(iter(schedule - set(r))) for r in out.tolist()}
    assert len(dropped) > 1  # not always the last step, unlike Flow-GRPO
    trained = {v for r in out.tolist() for v in r}
    assert 1.0 in trained and min(schedule) in trained  # both ends of the schedule can be trained
    again = nft_timesteps(sigmas, 0.99, True, torch.Generator().manual_seed(0), batch=64)
    assert torch.equal(out, again)


def test_timesteps_unshuffled_and_fraction():
    sigmas = sd3_sigmas(10, shift=3.0)
    assert torch.equal(nft_timesteps(sigmas, 0.99, shuffle=False), sigmas[:9])
    assert torch.equal(nft_timesteps(sigmas[:-1], 1.0, shuffle=False), sigmas[:10])
    assert nft_timesteps(sigmas, 0.05, shuffle=False).shape == (1,)  # max(1, int(10 * 0.05))
    per_sample = torch.stack([sigmas, sigmas * 0.5])
    out = nft_timesteps(per_sample, 0.5, shuffle=False)
    assert torch.equal(out, per_sample[:, :5])
    with pytest.raises(ValueError):
        nft_timesteps(sigmas, 0.0)
