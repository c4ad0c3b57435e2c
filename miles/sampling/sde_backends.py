"""SDE step backends: the transition kernel one denoising step uses, shared by the engine and the trainer.

`--diffusion-sde-type` picks the built-in backend: `sde` and `ode` -> `DiffusersSdeStepBackend` (Flow-SDE
over the scheduler sigmas; `ode` is the same class with eta = 0), `cps` -> `CpsSdeStepBackend` (log-prob
without constants). `--sde-step-backend-path pkg.module.MyBackend` names a `SdeStepBackend` subclass that
replaces that mapping for every stochastic step: the in-process diffusers engine samples with it and the
trainer re-scores the stored transitions with it, so both sides run the same kernel (the sglang engine
computes its own log-probs and is refused with the flag).

A backend is built once per process as `cls(args)` and implements

    sde_step_logprob(v, x, sigma, sigma_next, *, sde_type, noise_level, sigma_max=None, noise=None,
                     prev_sample=None, generator=None) -> miles.sampling.sde.StepResult

with the arguments and the result of `miles.sampling.sde.sde_step` (rollout: `prev_sample` None, sample the
next latent; trainer recompute: `prev_sample` given, return it with its log-prob, gradients through `mean`).
`sde_type` is the type the step was (or is) sampled with, so one backend may serve several types.
`--diffusion-log-prob-no-const` is read by the built-in backends (`self.no_const`).
"""

from __future__ import annotations

from typing import Any

import torch

from miles.sampling.sde import GeneratorArg, Scalar, StepResult, sde_step

FLAG = "--sde-step-backend-path"


class SdeStepBackend:
    """Base class of the SDE step backends (see the module docstring)."""

    sde_type: str = "sde"

    def __init__(self, args: Any) -> None:
        self.args = args
        self.no_const = bool(args.diffusion_log_prob_no_const)

    def sde_step_logprob(
        self,
        v: torch.Tensor,
        x: torch.Tensor,
        sigma: Scalar,
        sigma_next: Scalar,
        *,
        sde_type: str,
        noise_level: Scalar,
        sigma_max: Scalar | None = None,
        noise: torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        generator: GeneratorArg = None,
    ) -> StepResult:
        raise NotImplementedError


class DiffusersSdeStepBackend(SdeStepBackend):
    """Flow-matching SDE over the diffusers scheduler sigmas: std_dev_t = eta * sqrt(t / (1 - t)); eta = 0 is
    the ODE (Euler) step."""

    sde_type = "sde"

    def sde_step_logprob(self, v, x, sigma, sigma_next, *, sde_type, noise_level, **kwargs: Any) -> StepResult:  # type: ignore[override]
        kind = "ode" if sde_type == "ode" else self.sde_type
        return sde_step(
            v, x, sigma, sigma_next, sde_type=kind, noise_level=noise_level, no_const=self.no_const, **kwargs
        )


class CpsSdeStepBackend(DiffusersSdeStepBackend):
    """Coefficients-preserving sampling: std = sigma_next * sin(eta * pi / 2), log-prob without constants."""

    sde_type = "cps"


BUILTIN = {"sde": DiffusersSdeStepBackend, "ode": DiffusersSdeStepBackend, "cps": CpsSdeStepBackend}
_CACHE: dict[tuple[int, str], SdeStepBackend] = {}


def load_backend_class(path: str) -> type[SdeStepBackend]:
    """The `--sde-step-backend-path` class; ConfigError (one line naming the flag) when it is not a subclass."""
    from miles.core.errors import ConfigError
    from miles.utils.hooks import load_class

    cls = load_class(path, FLAG)
    if not issubclass(cls, SdeStepBackend):
        raise ConfigError(
            f"{FLAG} {path!r}: {cls.__name__} is not a subclass of {SdeStepBackend.__module__}.SdeStepBackend"
        )
    return cls


def sde_backend(args: Any, sde_type: str) -> SdeStepBackend:
    """The backend for steps of `sde_type`: the `--sde-step-backend-path` class, else the built-in one.
    One instance per (args, type) in this process."""
    key = (id(args), sde_type)
    backend = _CACHE.get(key)
    if backend is None or backend.args is not args:
        path = args.sde_step_backend_path
        if path:
            cls = load_backend_class(path)
        elif sde_type in BUILTIN:
            cls = BUILTIN[sde_type]
        else:
            raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {tuple(BUILTIN)}")
        backend = _CACHE[key] = cls(args)
    return backend


def backend_step(
    args: Any, v: torch.Tensor, x: torch.Tensor, sigma: Scalar, sigma_next: Scalar, **kwargs: Any
) -> StepResult:
    """`sde_step` through the backend of `kwargs['sde_type']` (the engine's and the trainer's call site).
    A `mask` (`TrainPipelineConfig.sde_mask`: some elements by ODE) only reaches the built-in backends."""
    backend = sde_backend(args, kwargs["sde_type"])
    if kwargs.get("mask") is not None and type(backend) not in BUILTIN.values():
        raise ValueError(
            f"{FLAG} {args.sde_step_backend_path!r}: this model family steps some latent "
            "elements by ODE inside the SDE step (sde_mask), which a custom backend does not implement"
        )
    result = backend.sde_step_logprob(v, x, sigma, sigma_next, **kwargs)
    if not isinstance(result, StepResult):
        path = args.sde_step_backend_path
        raise TypeError(f"{FLAG} {path!r} returned {type(result).__name__}; expected miles.sampling.sde.StepResult")
    return result
