"""Flow-matching SFT loss, noising and training-sigma sampling."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms.sft_loss import flow_matching_target, noisy_latents, sample_sigmas, sft_loss
from miles.sampling.sde import sd3_sigmas, shift_sigmas

D = torch.float64


def _data(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 8, 8, generator=g, dtype=D), torch.randn(batch, 4, 8, 8, generator=g, dtype=D)


def test_loss_zero_at_the_exact_velocity_and_value_otherwise():
    x0, noise = _data()
    loss, m = sft_loss(noise - x0, x0, noise, sigma=torch.tensor([0.1, 0.5, 0.9], dtype=D))
    assert loss.item() == 0.0 and m["loss"] == 0.0 and m["x0_mse"] == 0.0
    v = torch.randn_like(x0)
    loss, m = sft_loss(v, x0, noise)
    assert loss.item() == pytest.approx(((v - (noise - x0)) ** 2).mean().item(), rel=1e-12)
    assert "x0_mse" not in m


def test_gradient_sign_moves_the_prediction_to_the_target():
    x0, noise = _data()
    target = flow_matching_target(x0, noise)
    v = (target + 0.3).clone().requires_grad_(True)  # prediction above the target
    loss, _ = sft_loss(v, x0, noise)
    loss.backward()
    assert torch.allclose(v.grad, 2 * 0.3 * torch.ones_like(v) / v.numel())
    assert (v.grad > 0).all()  # descent lowers v toward the target
    with torch.no_grad():
        new_loss, _ = sft_loss(v - 100.0 * v.grad, x0, noise)
    assert new_loss.item() < loss.item()


def test_mask_averages_over_the_data_elements_only():
    x0, noise = _data()
    mask = torch.zeros(4, 8, 8, dtype=torch.bool)
    mask[:3] = True  # e.g. LTX-2: video channels carry data, the rest does not
    v = torch.randn_like(x0).requires_grad_(True)
    loss, m = sft_loss(v, x0, noise, sigma=torch.tensor([0.2, 0.5, 0.8], dtype=D), mask=mask)
    expected = ((v[:, :3] - (noise[:, :3] - x0[:, :3])) ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12) and m["loss"] == loss.item()
    loss.backward()
    assert not v.grad[:, 3:].any() and v.grad[:, :3].abs().min() > 0  # no gradient outside the mask
    other = x0.clone()
    other[:, 3:] = 100.0  # whatever lies outside the mask changes nothing
    assert sft_loss(v, other, noise, mask=mask)[0].item() == loss.item()
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        sft_loss(v, x0, noise, mask=mask.float())


def test_x0_mse_diagnostic_is_the_x0_space_error():
    x0, noise = _data()
    sigma = torch.tensor([0.2, 0.5, 0.8], dtype=D)
    v = torch.randn_like(x0)
    _, m = sft_loss(v, x0, noise, sigma=sigma)
    x_t = noisy_latents(x0, noise, sigma)
    x0_hat = x_t - sigma.view(-1, 1, 1, 1) * v
    assert m["x0_mse"] == pytest.approx(((x0_hat - x0) ** 2).mean().item(), rel=1e-10)


def test_noisy_latents_endpoints_and_per_sample_sigma():
    x0, noise = _data()
    assert torch.equal(noisy_latents(x0, noise, 0.0), x0)
    assert torch.equal(noisy_latents(x0, noise, 1.0), noise)
    sigma = torch.tensor([0.0, 0.5, 1.0], dtype=D)
    out = noisy_latents(x0, noise, sigma)
    assert torch.equal(out[0], x0[0]) and torch.equal(out[2], noise[2])
    assert torch.allclose(out[1], 0.5 * (x0[1] + noise[1]))
    with pytest.raises(ValueError):
        noisy_latents(x0, noise, torch.ones(2))


def test_sample_sigmas_uniform_grid_and_shift():
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(20000, g)
    assert s.dtype == torch.float32 and s.shape == (20000,)
    assert s.min().item() >= 1e-3 and s.max().item() <= 1.0
    assert s.mean().item() == pytest.approx(0.5, abs=0.01)
    # every value lies on the grid k / 1000
    assert torch.allclose(s * 1000, (s * 1000).round(), atol=1e-3)

    g = torch.Generator().manual_seed(0)
    shifted = sample_sigmas(20000, g, shift=3.0)
    assert torch.allclose(shifted, shift_sigmas(s.double(), 3.0).float(), atol=1e-6)  # same draws, shifted grid
    assert shifted.mean().item() > s.mean().item()

    assert torch.equal(
        sample_sigmas(10, torch.Generator().manual_seed(7)), sample_sigmas(10, torch.Generator().manual_seed(7))
    )


def test_sample_sigmas_from_a_scheduler_grid():
    grid = sd3_sigmas(10, shift=3.0)
    s = sample_sigmas(5000, torch.Generator().manual_seed(1), sigmas_grid=grid)
    values = set(s.tolist())
    assert values == set(grid[:-1].tolist())  # the terminal 0 is never drawn; every step is
    with pytest.raises(ValueError):
        sample_sigmas(1, sigmas_grid=torch.zeros(3))
