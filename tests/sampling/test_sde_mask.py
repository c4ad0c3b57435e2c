"""`sde_step(..., mask=...)`: some elements stochastic and scored, the rest by ODE (LTX-2: video by SDE, audio by
ODE, as sglang steps it). Without a mask the step is unchanged; with one, the masked-off elements are exactly the
Euler step, the others exactly the unmasked step, and the log-prob is the mean over the stochastic elements only.
A custom `--sde-step-backend-path` is refused with a mask (it would not honour it)."""

from __future__ import annotations

import pytest
import torch

from miles.config.resolution import schema_args
from miles.sampling.sde import sde_step
from miles.sampling.sde_backends import SdeStepBackend, backend_step


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 2, 4, 4, generator=g)
    v = torch.randn(3, 5, 2, 4, 4, generator=g)
    noise = torch.randn(3, 5, 2, 4, 4, generator=g)
    mask = torch.zeros(5, 2, 4, 4, dtype=torch.bool)
    mask[:3] = True  # three "video" channels; two "audio" ones
    return x, v, noise, mask


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_masked_step_is_sde_where_true_and_euler_where_false(sde_type: str) -> None:
    x, v, noise, mask = _case()
    kw = dict(sde_type=sde_type, noise_level=0.7, sigma_max=0.95, noise=noise)
    full = sde_step(v, x, 0.9, 0.8, **kw)
    masked = sde_step(v, x, 0.9, 0.8, mask=mask, **kw)
    euler = sde_step(v, x, 0.9, 0.8, sde_type="ode", noise_level=0.0)
    assert torch.equal(masked.prev_sample[:, :3], full.prev_sample[:, :3])
    assert torch.equal(masked.prev_sample[:, 3:], euler.prev_sample[:, 3:])  # bit-identical to the Euler step
    assert torch.equal(masked.mean[:, :3], full.mean[:, :3])
    # the log-prob is the unmasked step's on the stochastic elements alone
    alone = sde_step(v[:, :3], x[:, :3], 0.9, 0.8, **{**kw, "noise": noise[:, :3]})
    assert (masked.log_prob - alone.log_prob).abs().max().item() <= 1e-6
    assert (masked.log_prob - full.log_prob).abs().max().item() > 1e-3  # the audio elements would change it
    # a recompute of the stored transition gives the same log-prob back
    again = sde_step(
        v, x, 0.9, 0.8, sde_type=sde_type, noise_level=0.7, sigma_max=0.95, prev_sample=masked.prev_sample, mask=mask
    )
    assert torch.equal(again.log_prob, masked.log_prob)


def test_no_mask_is_the_step_as_before() -> None:
    x, v, noise, _ = _case(1)
    kw = dict(sde_type="sde", noise_level=0.7, sigma_max=0.95, noise=noise)
    a, b = sde_step(v, x, 1.0, 0.9, **kw), sde_step(v, x, 1.0, 0.9, mask=None, **kw)
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
    all_true = sde_step(v, x, 1.0, 0.9, mask=torch.ones(x.shape[1:], dtype=torch.bool), **kw)
    assert torch.equal(all_true.prev_sample, a.prev_sample)
    assert (all_true.log_prob - a.log_prob).abs().max().item() <= 1e-6


def test_a_mask_of_the_wrong_shape_is_refused() -> None:
    x, v, noise, mask = _case()
    with pytest.raises(ValueError, match="one sample's shape"):
        sde_step(v, x, 0.9, 0.8, sde_type="sde", noise_level=0.7, noise=noise, mask=mask[:2])


class _Custom(SdeStepBackend):
    def sde_step_logprob(self, v, x, sigma, sigma_next, **kwargs):  # pragma: no cover - refused before the call
        return sde_step(v, x, sigma, sigma_next, **kwargs)


def test_backend_step_passes_the_mask_to_builtins_and_refuses_a_custom_backend() -> None:
    x, v, noise, mask = _case()
    args = schema_args(sde_step_backend_path=None, diffusion_log_prob_no_const=False)
    res = backend_step(args, v, x, 0.9, 0.8, sde_type="sde", noise_level=0.7, sigma_max=0.95, noise=noise, mask=mask)
    direct = sde_step(v, x, 0.9, 0.8, sde_type="sde", noise_level=0.7, sigma_max=0.95, noise=noise, mask=mask)
    assert torch.equal(res.prev_sample, direct.prev_sample) and torch.equal(res.log_prob, direct.log_prob)
    custom = schema_args(sde_step_backend_path=f"{__name__}._Custom", diffusion_log_prob_no_const=False)
    with pytest.raises(ValueError, match="custom backend does not implement"):
        backend_step(custom, v, x, 0.9, 0.8, sde_type="sde", noise_level=0.7, noise=noise, mask=mask)
