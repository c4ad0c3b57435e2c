"""The measured transient peak of a real step of a `StepSpec`, to check the fake-tensor trace against.

On CPU torch has no allocator statistics (`torch.cpu` has no memory functions), so the step runs under
`torch.profiler.profile(profile_memory=True)` and its `[memory]` events (each allocation's and free's bytes, in time
order) are replayed: the peak of the running sum is what the step allocated on top of what was live before it (the
parameters, the inputs). On CUDA `torch.cuda.max_memory_allocated` minus the bytes allocated before the step gives
the same number (`bench/gpu_acceptance.sh`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.memory.step_spec import StepSpec


def profiled_peak(fn: Any) -> int:
    """Bytes: the peak of the allocations `fn()` makes (on CPU), over what was allocated when it started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += int(e.nbytes())
        peak = max(peak, live)
    return peak


def real_step(config_dir: Path, family: Any, spec: StepSpec, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """(the module with its real weights, a closure running the step once) on CPU."""
    from miles.memory.activations import GuidedStep, step_inputs
    from miles.models.loading import quiet_loading
    from miles.training.model import enable_gradient_checkpointing

    dtype = getattr(torch, spec.forward_dtype)
    with quiet_loading():
        if family.experts:
            cls = family.load_transformer_class()
            model = cls.from_pretrained(str(config_dir), subfolder=spec.components[0], dtype=dtype)
        else:
            model = family.load_denoiser(config_dir, dtype, spec.components)
    if spec.lora:
        from types import SimpleNamespace

        from miles.training.model import apply_lora

        args = SimpleNamespace(
            lora_rank=spec.lora[0], lora_alpha=spec.lora[1], lora_target_modules=list(spec.lora[2]),
            lora_init_weights="gaussian",
        )  # fmt: skip
        model = apply_lora(model, args, family)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
    if spec.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train() if spec.grad else model.eval()
    x, t, cond = step_inputs(spec, dtype, torch.Generator().manual_seed(seed))
    step = GuidedStep(model, family, 4.5 if spec.cfg else None)

    def run() -> None:
        with torch.set_grad_enabled(spec.grad):
            v = step(x, t, cond)
            if spec.grad:
                v.float().pow(2).mean().backward()
        del v
        for p in model.parameters():  # the next run starts from the same state
            p.grad = None

    return model, run


def measured_transient(config_dir: Path, family: Any, spec: StepSpec) -> int:
    """The transient peak of the real step, measured on its second run (the first warms kernels and caches).
    Gradients of the trainable parameters are subtracted: the static arithmetic counts them."""
    model, run = real_step(config_dir, family, spec)
    run()
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if spec.grad else 0
    return profiled_peak(run) - grads
