"""Trace one DiT forward (and backward) of a `StepSpec` at its real size on fake tensors: nothing is allocated.

How (shared/reference/memory_estimation.md): the module is built on the meta device outside any fake mode
(`meta_build`, LoRA injected there: a fake parameter cannot be moved or swapped); inside
`torch._subclasses.fake_tensor.FakeTensorMode` each parameter and buffer is replaced by an empty fake tensor on
'cpu' (a fake 'cuda' aborts a CPU build in autograd; under fake 'meta' SDPA takes the math kernel and saves L x L
attention matrices, whereas fake 'cpu' takes the flash kernel, which saves what CUDA's does: an output and a
logsumexp). `torch.distributed._tools.MemTracker` classifies every storage an op makes (activations in the
forward, temporaries in the backward); `PeakTracker` keeps only the global peaks (the stock per-module tables walk
every module on every op: minutes at real size) and installs no gradient hook on frozen parameters (the stock
tracker's `register_hook` raises on them: any LoRA model).

The parameters are materialised in the forward dtype: the copies FSDP2 all-gathers for the compute
(`MixedPrecisionPolicy(param_dtype=--diffusion-forward-dtype)`); their bytes, the gradients' and the optimizer's are
the static arithmetic's (`miles.memory.static`), so the trace reports only what the step adds on top of them:
`transient_peak`, the peak of activations plus backward temporaries. A family with experts routes each row to one
expert, so its step is traced on the first trained expert alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from miles.memory.meta_build import LoraSpec, build_component, build_denoiser, inject_lora
from miles.memory.step_spec import StepSpec


class _NoHook:
    def remove(self) -> None:
        pass


def _peak_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    transient_kinds = (_MemRefType.ACT, _MemRefType.TEMP)

    class PeakTracker(MemTracker):
        """MemTracker keeping the global peak of all tracked bytes and of the transient (activation + temp) ones."""

        def __init__(self) -> None:
            super().__init__()
            self.transient_peak = 0
            self.forward_peak = 0

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                transient = sum(snap.get(k, 0) for k in transient_kinds)
                if transient > self.transient_peak:
                    self.transient_peak = transient
                if not self._mod_tracker.is_bw and transient > self.forward_peak:
                    self.forward_peak = transient
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def skip_frozen(self, module: torch.nn.Module) -> None:
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())

    return PeakTracker


class GuidedStep(torch.nn.Module):
    """The family's guided forward as one root module: MemTracker refuses a second root-level call of a module, and
    a family that does not batch CFG calls the DiT twice per step."""

    def __init__(self, model: torch.nn.Module, family: Any, cfg_scale: float | None) -> None:
        super().__init__()
        self.model, self.family, self.cfg_scale = model, family, cfg_scale

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        neg = cond if self.cfg_scale is not None else None
        return self.family.guided_velocity(self.model, x, t, cond, neg, self.cfg_scale)


def step_module(config_dir: Path, family: Any, spec: StepSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The denoiser `spec` steps (one expert of an expert family), its LoRA and gradient checkpointing applied."""
    lora = LoraSpec(spec.lora[0], spec.lora[1], tuple(spec.lora[2])) if spec.lora else None
    if family.experts:
        model = build_component(config_dir, spec.components[0], dtype)
        if lora is not None:
            model = inject_lora(model, lora, family)
    else:
        model = build_denoiser(config_dir, family, spec.components, dtype, lora)
    if spec.gradient_checkpointing:
        from miles.training.model import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    return model.train() if spec.grad else model.eval()


def materialize(model: torch.nn.Module) -> None:
    """Inside FakeTensorMode: every parameter, buffer and plain tensor attribute becomes an empty fake 'cpu' tensor
    of its shape and dtype."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                fake = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                module._parameters[name] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        for name, value in list(vars(module).items()):  # plain tensor attributes (e.g. Qwen-Image's RoPE tables)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.is_meta:
                setattr(module, name, torch.empty(value.shape, dtype=value.dtype, device="cpu"))


def step_inputs(
    spec: StepSpec, dtype: torch.dtype, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The micro-batch of `spec`: latents, timesteps, conditions (random floats; integer inputs are ones)."""
    b = spec.batch
    x = torch.randn((b, *spec.latent), generator=generator).to(dtype)
    t = torch.full((b,), float(spec.timestep), dtype=torch.float32)
    cond: dict[str, Any] = {}
    for name, shape, dt in spec.conditions:
        kind = getattr(torch, dt) if dt else dtype
        if shape is None:
            cond[name] = None
        elif kind.is_floating_point:
            cond[name] = torch.randn((b, *shape), generator=generator).to(kind)
        else:
            cond[name] = torch.ones((b, *shape), dtype=kind)
    return x, t, cond


def trace_step(config_dir: Path, family: Any, spec: StepSpec) -> dict[str, Any]:
    """{"transient_peak", "forward_peak", "traced_params", "seconds", "ops"}: bytes and wall seconds of the trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.models.loading import quiet_loading

    start = time.perf_counter()
    dtype = getattr(torch, spec.forward_dtype)
    model = step_module(config_dir, family, spec, dtype)
    tracker_cls = _peak_tracker_class()
    with quiet_loading(), FakeTensorMode():
        materialize(model)
        x, t, cond = step_inputs(spec, dtype)
        tracker = tracker_cls()
        tracker.skip_frozen(model)
        tracker.track_external(model, x, t, *(v for v in cond.values() if v is not None))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        step = GuidedStep(model, family, 4.5 if spec.cfg else None)
        with tracker:
            with torch.set_grad_enabled(spec.grad):
                v = step(x, t, cond)
                if spec.grad:
                    v.float().pow(2).mean().backward()
            del v
    return {
        "transient_peak": int(tracker.transient_peak),
        "forward_peak": int(tracker.forward_peak),
        "traced_params": int(params),
        "seconds": round(time.perf_counter() - start, 2),
    }
