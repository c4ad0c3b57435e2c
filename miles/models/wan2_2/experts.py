"""Wan2.2's two experts as one module: `transformer` denoises the high-noise steps (t >= the boundary),
`transformer_2` the low-noise ones.

`WanExperts` holds the experts a job loads (`--update-weight-target-module`: both, or one) under their
pipeline names, so its state-dict names are `transformer.<...>` / `transformer_2.<...>`, the names the
engine's view of the pipeline (`WanExperts.of_pipeline`) and sglang's weight sync use. Its forward routes
each row by its own timestep, so a trainer micro-batch may mix the denoising phases; a row whose expert is
not loaded is an error naming it. Under torch.distributed every loaded expert runs on every rank (on one
dummy row when a rank has none of its rows, its output multiplied by zero), so all ranks reach the same
FSDP collectives whatever phases their micro-batches hold.
"""

from __future__ import annotations

from typing import Any

import torch

HIGH, LOW = "transformer", "transformer_2"
EXPERTS = (HIGH, LOW)


class WanExperts(torch.nn.Module):
    def __init__(self, experts: dict[str, torch.nn.Module], boundary_timestep: float) -> None:
        super().__init__()
        unknown = [k for k in experts if k not in EXPERTS]
        if unknown or not experts:
            raise ValueError(f"Wan experts are {EXPERTS}, got {sorted(experts)}")
        for name in EXPERTS:
            if name in experts:
                self.add_module(name, experts[name])
        self.loaded = tuple(n for n in EXPERTS if n in experts)
        self.boundary_timestep = float(boundary_timestep)

    @classmethod
    def of_pipeline(cls, pipe: Any) -> WanExperts:
        """A view of a `WanPipeline`'s experts (the same modules, not copies) with its boundary."""
        experts = {n: getattr(pipe, n) for n in EXPERTS if getattr(pipe, n, None) is not None}
        return cls(experts, boundary_timestep(pipe.config.boundary_ratio, pipe.scheduler.config.num_train_timesteps))

    def expert_for(self, timestep: float) -> str:
        return HIGH if float(timestep) >= self.boundary_timestep else LOW

    @property
    def config(self) -> Any:
        return getattr(self, self.loaded[0]).config

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor]:
        high = timestep.reshape(-1) >= self.boundary_timestep
        rows = {HIGH: high.nonzero().reshape(-1), LOW: (~high).nonzero().reshape(-1)}
        for name, idx in rows.items():
            if len(idx) and name not in self.loaded:
                t = float(timestep.reshape(-1)[idx[0]])
                raise ValueError(
                    f"timestep {t:g} is denoised by Wan expert {name!r}, which this job does not load "
                    f"(--update-weight-target-module {','.join(self.loaded)})"
                )
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        distributed = distributed and torch.distributed.get_world_size() > 1
        busy = [n for n in self.loaded if len(rows[n])]
        if len(busy) == 1 and (not distributed or len(self.loaded) == 1):
            expert = getattr(self, busy[0])
            return (expert(hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0],)
        out: torch.Tensor | None = None
        idle: list[torch.Tensor] = []
        for name in self.loaded:
            idx = rows[name]
            dummy = len(idx) == 0
            if dummy:
                idx = torch.zeros(1, dtype=torch.long, device=timestep.device)
            y = getattr(self, name)(
                hidden_states[idx], timestep.reshape(-1)[idx], encoder_hidden_states[idx], return_dict=False, **kwargs
            )[0]
            if dummy:
                idle.append(y)
                continue
            if out is None:
                out = y.new_zeros((hidden_states.shape[0], *y.shape[1:]))
            out = out.index_copy(0, idx, y)
        assert out is not None
        for y in idle:  # keep the idle expert in the graph: its backward collectives run on every rank too
            out = out + 0.0 * y.sum()
        return (out,)


def boundary_timestep(boundary_ratio: float | None, num_train_timesteps: int = 1000) -> float:
    """The timestep from which `transformer` (the high-noise expert) denoises; no ratio: only it (0)."""
    return 0.0 if boundary_ratio is None else float(boundary_ratio) * float(num_train_timesteps)
