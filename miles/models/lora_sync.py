"""LoRA-only weight sync (`--use-lora --lora-ipc-weight-sync`): the trainer's payload, the engine's merge.

Instead of the whole LoRA-merged transformer, the trainer sends three tensors per adapted module
`<module>` (its name in the plain transformer, e.g. `transformer_blocks.0.attn.to_q`):

    <module>.lora_A        [r, in]   the adapter's A (full tensor, gathered from the FSDP2 shards)
    <module>.lora_B        [out, r]  the adapter's B
    <module>.lora_scaling  0-d fp64  peft's scaling of the adapter (lora_alpha / r)

so every name carries `lora_`. A sync is LoRA-only under `--use-lora` with `--lora-ipc-weight-sync` or with
sglang engines (`lora_only_sync`: the trainer's payload, its offload before the sync and the memory plan ask it).

The engine keeps a copy of each adapted module's base weight the first time it merges into it and sets
`W = W_base + scaling * B @ A` (fp32 math, cast to the engine's dtype), so repeated syncs never compound.
The copies live in host memory: pinned when the weights are on a GPU, where only the module being merged has
its base on the device (for that merge); a plain CPU clone on a CPU engine. The three tensors of a module may
arrive in different chunks of `--update-weight-buffer-size`; the engine merges a module once it holds all
three. A full-weight update of `<module>.weight` replaces the weight and drops its base copy (the next LoRA
merge starts from it).

The flag requires --colocate, under which every sync passes the engines handles, not copies
(`miles.training.in_place_sync`): CUDA IPC on GPUs, shared memory on a CPU machine. An engine gets the
tensors of one bucket per call: the fp64 scalings come first, in their own bucket, and wait in `pending`
(as copies) until their module's A and B arrive, which then merge straight from the trainer's memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PARTS = ("lora_A", "lora_B", "lora_scaling")


def lora_only_sync(args: Any) -> bool:
    """Whether a weight sync of a trainer with `args` pushes only the LoRA tensors (`lora_sync_payload`), not the
    merged model: `--use-lora` with `--lora-ipc-weight-sync`, or with sglang engines (they take the adapter through
    `lora_merge` / `/v1/set_lora`). Such a sync reads nothing of the model but its adapters (and the EMA shadow
    when it is served), so the frozen base may leave the device before it (`Trainer.offload`'s "frozen"). Torch-free:
    the memory plan (`miles.memory.static`) asks it too."""
    return bool(args.use_lora) and (bool(args.lora_ipc_weight_sync) or args.rollout_backend == "sglang")


def merge_lora_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`base + scaling * b @ a`, computed in fp32 and returned in `base`'s dtype (the trainer's formula too)."""
    if b.shape[1] != a.shape[0] or base.shape != (b.shape[0], a.shape[1]):
        raise ValueError(f"LoRA shapes do not fit: weight {tuple(base.shape)}, B {tuple(b.shape)}, A {tuple(a.shape)}")
    a, b = a.to(base.device), b.to(base.device)
    return (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)


def lora_sync_payload(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA tensors of a peft-injected (and possibly FSDP2-sharded) model, as full CPU tensors.

    Call it on every rank: gathering a sharded tensor is a collective.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        out[f"{name}.lora_A"] = _full(module.lora_A[adapter].weight)
        out[f"{name}.lora_B"] = _full(module.lora_B[adapter].weight)
        out[f"{name}.lora_scaling"] = torch.tensor(float(module.scaling[adapter]), dtype=torch.float64)
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").clone()


def is_lora_entry(name: str) -> bool:
    return name.rpartition(".")[2] in PARTS


def base_copy(value: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`value` (the base of `weight`) as the merger keeps it: a copy in `weight`'s dtype in host memory, pinned
    when `weight` is on a GPU (its merge then brings it over by DMA); a plain CPU clone next to CPU weights."""
    import torch

    value = value.detach()
    if weight.device.type == "cpu":
        return value.to(dtype=weight.dtype, copy=True)
    out = torch.empty(value.shape, dtype=weight.dtype, device="cpu", pin_memory=weight.is_cuda)
    out.copy_(value)
    return out


class LoraMerger:
    """Engine side: the base copies of the adapted weights (in host memory, `base_copy`) and the parts of modules
    not yet complete. A module's base is on the weight's device only while it merges."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def apply(self, module: torch.nn.Module, entries: dict[str, torch.Tensor]) -> list[str]:
        """Take LoRA entries (`<module>.lora_A|lora_B|lora_scaling`); merge every completed module into
        `module`'s weights; returns the modules merged."""
        import torch

        params = dict(module.named_parameters())
        for name, tensor in entries.items():
            prefix, _, part = name.rpartition(".")
            if part not in PARTS:
                raise KeyError(f"not a LoRA sync entry: {name!r} (expected <module>.lora_A|lora_B|lora_scaling)")
            if f"{prefix}.weight" not in params:
                raise KeyError(f"engine transformer has no module {prefix!r} to merge LoRA into")
            self.pending.setdefault(prefix, {})[part] = tensor
        merged = []
        with torch.no_grad():
            for prefix in [p for p, parts in self.pending.items() if len(parts) == len(PARTS)]:
                parts = self.pending.pop(prefix)
                weight = params[f"{prefix}.weight"]
                base = self.base.get(prefix)
                if base is None:
                    base = self.base[prefix] = base_copy(weight, weight)
                # on the device for this merge only (the same tensor on a CPU engine); the copy's stream order
                # makes the merge read it complete
                on_device = base.to(weight.device, non_blocking=True)
                a, b, scaling = parts["lora_A"], parts["lora_B"], float(parts["lora_scaling"])
                weight.copy_(merge_lora_weight(on_device, a, b, scaling))
                del on_device
                merged.append(prefix)
        return merged

    def restore(self, module: torch.nn.Module, base: dict[str, torch.Tensor]) -> None:
        """Take base copies saved elsewhere (an engine's `export_weights`), kept as `apply` keeps its own."""
        params = dict(module.named_parameters())
        self.base = {prefix: base_copy(value, params[f"{prefix}.weight"]) for prefix, value in base.items()}
        self.pending = {}

    def own_pending(self) -> None:
        """Copy the parts still waiting for the rest of their module: they may be views of memory a sender
        passed by handle (`miles.models.weight_ipc`) and frees once the call returns."""
        for parts in self.pending.values():
            for part, tensor in parts.items():
                parts[part] = tensor.clone()

    def forget(self, names: Any) -> None:
        """Full weights arrived for `names`: their base copies are stale."""
        for name in names:
            if name.endswith(".weight"):
                self.base.pop(name[: -len(".weight")], None)
