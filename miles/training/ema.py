"""The EMA shadow of the trained weights (`--use-ema`), used as pi_old / the `--ref-mode ema` reference or pushed
to the engines with `--ema-rollout-policy ema`.

    decay_at(t) = decay_init                             if t <= flat_steps
                = min((t - flat_steps) * ramp, decay_max)  otherwise     (the ramp restarts from zero)
    theta_ema <- decay * theta_ema + (1 - decay) * theta

`t` is the update count, incremented before use (the first update uses t = 1). The shadow is kept in fp32 whatever
the parameters' dtype; under FSDP2 a DTensor parameter gets a DTensor shadow with the same sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

NamedParams = Iterable[tuple[str, torch.Tensor]]


def _reshard(module: torch.nn.Module | None) -> None:
    """Drop FSDP2's unsharded parameter copies so the next forward all-gathers the values just written.

    The root FSDP module keeps its parameters unsharded after a forward; without this, a forward after a swap
    would reuse the stale gathered weights."""
    if module is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


class EmaShadow:
    """An fp32 copy of the given parameters, updated by `update` after each optimizer step.

    `named_params` is e.g. `model.named_parameters()`; parameters that do not require grad (frozen LoRA base
    weights) are not tracked. Methods that take `named_params` ignore untracked names and fail if a tracked one
    is missing.

    Under FSDP2 pass the wrapped model as `module=` everywhere, with `named_params` a fresh (lazy)
    `model.named_parameters()`: the root FSDP module keeps gathered plain-tensor parameters after a forward, and
    `module` lets this class reshard first, so it always reads and writes the sharded DTensor parameters.
    """

    def __init__(
        self,
        named_params: NamedParams,
        decay_init: float = 0.001,
        decay_ramp: float = 0.001,
        decay_max: float = 0.5,
        flat_steps: int = 0,
        *,
        module: torch.nn.Module | None = None,
    ) -> None:
        for name, value in (("decay_init", decay_init), ("decay_ramp", decay_ramp), ("decay_max", decay_max)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"EmaShadow: {name} must lie in [0, 1], got {value}")
        if flat_steps < 0:
            raise ValueError(f"EmaShadow: flat_steps must be >= 0, got {flat_steps}")
        self.decay_init = float(decay_init)
        self.decay_ramp = float(decay_ramp)
        self.decay_max = float(decay_max)
        self.flat_steps = int(flat_steps)
        self.num_updates = 0
        _reshard(module)  # before the (lazy) named_params is read: FSDP2 then yields the sharded parameters
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                name: param.detach().to(torch.float32, copy=True)
                for name, param in named_params
                if param.requires_grad
            }
        if not self.shadow:
            raise ValueError("EmaShadow: no trainable parameters to track")

    @classmethod
    def from_args(cls, named_params: NamedParams, args: Any, *, module: torch.nn.Module | None = None) -> EmaShadow:
        return cls(
            named_params,
            decay_init=args.ema_decay_init,
            decay_ramp=args.ema_decay_ramp,
            decay_max=args.ema_decay_max,
            flat_steps=args.ema_decay_flat_steps,
            module=module,
        )

    def decay_at(self, t: int) -> float:
        if t <= self.flat_steps:
            return self.decay_init
        return min((t - self.flat_steps) * self.decay_ramp, self.decay_max)

    def _tracked(
        self, named_params: NamedParams, module: torch.nn.Module | None = None
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        params = dict(named_params)
        if module is not None:
            # FSDP2: a reshard swaps the registered parameters (unsharded copies -> sharded ones) and frees the
            # copies, so parameters collected before it (e.g. after a forward with no backward) are stale
            current = dict(module.named_parameters())
            params = {name: current.get(name, param) for name, param in params.items()}
        missing = [name for name in self.shadow if name not in params]
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise KeyError(f"EmaShadow: {len(missing)} tracked parameter(s) not given: {shown}")
        return [(name, params[name], shadow) for name, shadow in self.shadow.items()]

    @torch.no_grad()
    def update(self, named_params: NamedParams, module: torch.nn.Module | None = None) -> float:
        """One EMA step towards the current weights; returns the decay used."""
        _reshard(module)
        tracked = self._tracked(named_params, module)
        self.num_updates += 1
        decay = self.decay_at(self.num_updates)
        for _, param, shadow in tracked:
            shadow.mul_(decay).add_(param.detach().to(torch.float32), alpha=1.0 - decay)
        return decay

    @torch.no_grad()
    def copy_to(self, named_params: NamedParams, module: torch.nn.Module | None = None) -> None:
        """Overwrite the parameters with the EMA weights (cast to each parameter's dtype). Under FSDP2 pass the
        wrapped `module` too, so its gathered parameter copies are dropped."""
        _reshard(module)
        tracked = self._tracked(named_params, module)
        for _, param, shadow in tracked:
            param.detach().copy_(shadow)
        _reshard(module)

    @contextlib.contextmanager
    def swapped_in(self, named_params: NamedParams, module: torch.nn.Module | None = None) -> Iterator[None]:
        """`with ema.swapped_in(model.named_parameters(), model): ...` runs the block on the EMA weights and puts
        the raw weights back bit for bit afterwards, even if the block raises. `module` (the FSDP2-wrapped model)
        is needed under FSDP2 only: see `_reshard`."""
        _reshard(module)
        tracked = self._tracked(named_params, module)
        with torch.no_grad():
            backup = [param.detach().clone() for _, param, _ in tracked]
            for _, param, shadow in tracked:
                param.detach().copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                _reshard(module)
                for (_, param, _), saved in zip(tracked, backup, strict=True):
                    param.detach().copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        """The shadow tensors (by reference, like torch.optim) and the update count; the decay settings are
        recorded for information and not restored (the resumed run's flags apply)."""
        return {
            "num_updates": self.num_updates,
            "shadow": dict(self.shadow),
            "decay_init": self.decay_init,
            "decay_ramp": self.decay_ramp,
            "decay_max": self.decay_max,
            "flat_steps": self.flat_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = state["shadow"]
        if set(loaded) != set(self.shadow):
            missing = sorted(set(self.shadow) - set(loaded))[:5]
            extra = sorted(set(loaded) - set(self.shadow))[:5]
            raise KeyError(
                f"EmaShadow.load_state_dict: parameter names differ (missing {missing}, unexpected {extra})"
            )
        for name, shadow in self.shadow.items():
            value = loaded[name]
            if hasattr(shadow, "device_mesh") and not hasattr(value, "device_mesh"):
                # A full tensor saved from a gathered state: shard it like the live shadow.
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(shadow.device), shadow.device_mesh, shadow.placements)
            if value.shape != shadow.shape:
                raise ValueError(
                    f"EmaShadow.load_state_dict: {name} has shape {tuple(value.shape)}, expected {tuple(shadow.shape)}"
                )
            shadow.copy_(value)
        self.num_updates = int(state["num_updates"])
