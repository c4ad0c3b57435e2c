"""Moving tensors' memory off their device between phases and back, bit for bit.

The unit is the storage behind a tensor: its bytes are copied to CPU memory (pinned when the device is a
GPU) and the storage is shrunk to nothing, which frees the device memory while every tensor, view,
parameter, FSDP2 shard and optimizer-state reference keeps pointing at the same storage object; onload
grows the storage back and copies the bytes in. Nothing is rebuilt, so no module, optimizer or FSDP2
bookkeeping has to be told. On a CPU-only machine the same code copies into a second CPU buffer and frees
the first one, so the mechanics (and their cost in bytes and seconds) are exercised there too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class Moved:
    bytes: int = 0
    seconds: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {"bytes": float(self.bytes), "seconds": self.seconds}


class Offloader:
    """Offloads the storages of the tensors it is given (those on `device`), and onloads all of them."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stash: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._keys: set[int] = set()

    @property
    def offloaded_bytes(self) -> int:
        return sum(buffer.numel() for _, buffer in self._stash)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        device = tensor.device
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index in (None, self.device.index)

    def offload(self, tensors: Iterable[torch.Tensor]) -> Moved:
        """Move the storages of `tensors` (each storage once) off the device; returns bytes and seconds."""
        start = time.perf_counter()
        moved = 0
        first_new = len(self._stash)
        pin = self.device.type == "cuda"
        with torch.no_grad():
            locals_ = [t for t in (_local(t) for t in tensors) if t is not None and self._on_device(t)]
            users: dict[int, int] = {}
            for local in {id(t): t for t in locals_}.values():
                key = local.untyped_storage()._cdata
                users[key] = users.get(key, 0) + 1
            for local in locals_:
                storage = local.untyped_storage()
                if not storage.resizable():
                    if users.get(storage._cdata, 0) > 1 or not _owns_storage(local):
                        continue  # shared memory torch cannot free (e.g. a numpy array's): it stays
                    local.data = local.data.clone()  # a tensor built on foreign memory gets torch's own
                    storage = local.untyped_storage()
                key = storage._cdata
                if key in self._keys or storage.nbytes() == 0:
                    continue
                buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
                buffer.untyped_storage().copy_(storage, non_blocking=pin)
                self._stash.append((storage, buffer))
                self._keys.add(key)
                moved += storage.nbytes()
            if pin:
                torch.cuda.synchronize(self.device)
            for storage, _ in self._stash[first_new:]:
                storage.resize_(0)
            if pin:
                torch.cuda.empty_cache()
        return Moved(moved, time.perf_counter() - start)

    def onload(self) -> Moved:
        """Bring every offloaded storage back, bytes unchanged."""
        start = time.perf_counter()
        moved = 0
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for storage, buffer in self._stash:
                storage.resize_(buffer.numel())
                storage.copy_(buffer.untyped_storage(), non_blocking=pin)
                moved += buffer.numel()
            if pin:
                torch.cuda.synchronize(self.device)
        self._stash.clear()
        self._keys.clear()
        return Moved(moved, time.perf_counter() - start)


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor holding the memory: a DTensor's local shard, else the tensor itself."""
    if tensor is None:
        return None
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def own_memory(modules: Iterable[torch.nn.Module]) -> int:
    """Copy every parameter and buffer that lives in memory torch did not allocate (a safetensors mmap, a
    numpy array) into torch's own memory, once; returns the count. An engine does this at load, so its
    weights compute the same before and after an offload round trip (which needs resizable storages), and the
    same as the trainer's: a safetensors mmap puts a tensor at any byte offset, and CPU GEMM kernels round
    differently on unaligned operands (tiny-cosmos3's velocity moved 4.8e-7), while torch's allocator (and so
    FSDP2's) aligns every storage to 64 bytes."""
    count = 0
    with torch.no_grad():
        for tensor in module_tensors(modules):
            if not tensor.untyped_storage().resizable() and _owns_storage(tensor):
                tensor.data = tensor.data.clone()
                count += 1
    return count


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules`."""
    out: list[torch.Tensor] = []
    for module in modules:
        out.extend(module.parameters())
        out.extend(module.buffers())
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (Adam's moments, ...)."""
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
