"""--sde-step-backend-path and --diffusion-log-prob-no-const: one kernel for the engine and the trainer."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.sampling.sde import StepResult, sde_step
from miles.sampling.sde_backends import CpsSdeStepBackend, DiffusersSdeStepBackend, backend_step, sde_backend

CALLS: list[tuple[str, bool]] = []


class CountingBackend(DiffusersSdeStepBackend):
    def sde_step_logprob(self, v, x, sigma, sigma_next, *, sde_type, noise_level, **kwargs: Any) -> StepResult:
        CALLS.append((sde_type, kwargs.get("prev_sample") is not None))
        return super().sde_step_logprob(v, x, sigma, sigma_next, sde_type=sde_type, noise_level=noise_level, **kwargs)


class NotABackend:
    pass


def args(**kw: Any) -> Args:
    return schema_args(**kw)


def _rollout_then_recompute(a: Args, sde_type: str) -> tuple[StepResult, StepResult]:
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, 5, generator=g), torch.randn(3, 4, 5, 5, generator=g)
    noise = torch.randn(3, 4, 5, 5, generator=g)
    kw = {"sde_type": sde_type, "noise_level": 0.7, "sigma_max": 0.9}
    engine = backend_step(a, v, x, 0.8, 0.6, noise=noise, **kw)  # the engine's call site
    trainer = backend_step(a, v.clone(), x, 0.8, 0.6, prev_sample=engine.prev_sample, **kw)  # the trainer's
    return engine, trainer


def test_builtin_mapping() -> None:
    a = args()
    assert type(sde_backend(a, "sde")) is DiffusersSdeStepBackend
    assert type(sde_backend(a, "ode")) is DiffusersSdeStepBackend
    assert type(sde_backend(a, "cps")) is CpsSdeStepBackend


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_user_backend_serves_engine_and_trainer(sde_type: str) -> None:
    CALLS.clear()
    engine, trainer = _rollout_then_recompute(args(sde_step_backend_path=f"{__name__}.CountingBackend"), sde_type)
    assert [(sde_type, False), (sde_type, True)] == CALLS
    assert torch.equal(engine.log_prob, trainer.log_prob)


def test_backend_path_must_name_a_subclass() -> None:
    with pytest.raises(ConfigError, match=r"^--sde-step-backend-path .*NotABackend.* not a subclass of"):
        sde_backend(args(sde_step_backend_path=f"{__name__}.NotABackend"), "sde")


def test_log_prob_no_const_engine_and_trainer_agree() -> None:
    full_engine, _ = _rollout_then_recompute(args(), "sde")
    engine, trainer = _rollout_then_recompute(args(diffusion_log_prob_no_const=True), "sde")
    assert torch.equal(engine.log_prob, trainer.log_prob)  # recompute diff 0
    assert torch.equal(engine.prev_sample, full_engine.prev_sample)  # same sample, only the density differs
    const = -torch.log(engine.std) - math.log(math.sqrt(2 * math.pi))
    torch.testing.assert_close(full_engine.log_prob, engine.log_prob + const)
    assert not torch.allclose(full_engine.log_prob, engine.log_prob)


def test_log_prob_no_const_leaves_cps_alone() -> None:
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    with_const = sde_step(v, x, 0.5, 0.3, sde_type="cps", noise_level=0.5, generator=torch.Generator().manual_seed(2))
    without = sde_step(
        v, x, 0.5, 0.3, sde_type="cps", noise_level=0.5, generator=torch.Generator().manual_seed(2), no_const=True
    )
    assert torch.equal(with_const.log_prob, without.log_prob)  # cps has no constants to drop
