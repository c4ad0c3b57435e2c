"""Weight sync by handle: a state dict packed into flat buckets and sent as torch multiprocessing handles.

Under `--colocate` a trainer rank and its engine share a device, so a sync need not copy the weights
through Ray's object store: the trainer packs them into buckets on their device and sends only handles,
and the engine maps the same memory and loads from it.

- `plan` / `pack_bucket`: per dtype, buckets of at most `--update-weight-buffer-size` bytes (a larger
  tensor travels alone; a `unit` of names, e.g. one LoRA module's A and B, is never split). A bucket is
  one uint8 tensor on the tensors' device (in shared memory on CPU) holding every tensor at a byte offset.
- `serialize`: ForkingPickler bytes of `{"transformer": {"flattened_tensor", "metadata"}}`, sglang's
  `load_format="flattened_bucket"` payload for one target module (metadata as SimpleNamespace, so no
  sglang class is pickled; `serialize_b64` is sglang's `MultiprocessingSerializer` string). On CPU the
  handle is `rebuild_storage_filename`: a /dev/shm name (the `file_system` sharing strategy), which
  survives being sent as plain bytes to an unrelated process on the same node; on CUDA the same code
  yields CUDA-IPC handles.
- `rebuild`: the receiver's side, the named tensors as views into the mapped bucket.

The sender keeps a bucket alive until the receiver has loaded it, then `Bucket.free()`s it. A payload is
about 350 bytes per bucket plus about 100 per tensor, whatever the weights weigh.
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

SHARING_STRATEGY = "file_system"
TARGET_MODULE = "transformer"

# what a payload may name when unpickled (sglang's SafeUnpickler allows the same)
_ALLOWED = {
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("types", "SimpleNamespace"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
}


@dataclass
class Entry:
    """One tensor of a bucket: bytes `[start, end)` of the flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Bucket:
    flat: torch.Tensor | None  # uint8, on the tensors' device (CPU: shared memory)
    entries: list[Entry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.entries[-1].end if self.entries else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        assert self.flat is not None, "bucket already freed"
        return {e.name: _view(self.flat, e) for e in self.entries}

    def free(self) -> None:
        self.flat = None


@dataclass
class IpcStats:
    """What one sync moved: tensors and bytes passed by handle, bytes of serialized handles sent."""

    tensors: int = 0
    buckets: int = 0
    bytes_by_handle: int = 0
    bytes_serialized: int = 0

    def add(self, bucket: Bucket, payload_bytes: int) -> None:
        self.tensors += len(bucket.entries)
        self.buckets += 1
        self.bytes_by_handle += bucket.nbytes
        self.bytes_serialized += payload_bytes


def use_file_system_sharing() -> None:
    """CPU handles must name a /dev/shm file (the default strategy passes a file descriptor, which only a
    multiprocessing connection can carry)."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != SHARING_STRATEGY:
        mp.set_sharing_strategy(SHARING_STRATEGY)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _view(flat: torch.Tensor, entry: Entry) -> torch.Tensor:
    return flat[entry.start : entry.end].view(entry.dtype).view(entry.shape)


def _units(names: list[str], unit: Callable[[str], str] | None) -> list[list[str]]:
    """Consecutive names with the same `unit(name)` stay together."""
    out: list[list[str]] = []
    last: object = object()
    for name in names:
        key = unit(name) if unit is not None else name
        if out and key == last:
            out[-1].append(name)
        else:
            out.append([name])
        last = key
    return out


def plan(
    state: dict[str, torch.Tensor], buffer_bytes: int, unit: Callable[[str], str] | None = None
) -> list[list[str]]:
    """The names of each bucket: grouped by dtype, the group with the fewest bytes first (a LoRA module's
    fp64 scaling then reaches an engine before its A and B, which merge straight from the sender's
    memory), each group cut at `buffer_bytes`."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, tensor in state.items():
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(name)
    groups = sorted(by_dtype.values(), key=lambda names: sum(_nbytes(state[n]) for n in names))
    buckets: list[list[str]] = []
    for names in groups:
        current: list[str] = []
        size = 0
        for group in _units(names, unit):
            nbytes = sum(_nbytes(state[n]) for n in group)
            if current and size + nbytes > buffer_bytes:
                buckets.append(current)
                current, size = [], 0
            current.extend(group)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def pack_bucket(state: dict[str, torch.Tensor], names: Iterable[str], device: torch.device | None = None) -> Bucket:
    """Copy `names` of `state` (one dtype) into one flat buffer on `device` (default: the tensors' own)."""
    entries: list[Entry] = []
    offset = 0
    for name in names:
        tensor = state[name]
        entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), offset, offset + _nbytes(tensor)))
        offset += _nbytes(tensor)
    target = device or state[entries[0].name].device
    flat = torch.empty(offset, dtype=torch.uint8, device=target)
    if flat.device.type == "cpu":
        use_file_system_sharing()
        flat.share_memory_()
    with torch.no_grad():
        for entry in entries:
            _view(flat, entry).copy_(state[entry.name])
    return Bucket(flat, entries)


def pack(
    state: dict[str, torch.Tensor],
    buffer_bytes: int,
    unit: Callable[[str], str] | None = None,
    device: torch.device | None = None,
) -> list[Bucket]:
    """Every bucket of `state` at once (the sender usually packs, sends and frees one at a time)."""
    return [pack_bucket(state, names, device) for names in plan(state, buffer_bytes, unit)]


def serialize(bucket: Bucket, module: str = TARGET_MODULE) -> bytes:
    """The bucket's handles: sglang's `flattened_bucket` payload for `module`, pickled with torch's reductions."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    assert bucket.flat is not None, "bucket already freed"
    if bucket.flat.device.type == "cpu":
        use_file_system_sharing()
        if not bucket.flat.is_shared():
            raise ValueError("a CPU bucket must be in shared memory to be sent by handle")
    metadata = [
        types.SimpleNamespace(
            name=e.name, shape=e.shape, dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.end - e.start
        )
        for e in bucket.entries
    ]
    buf = io.BytesIO()
    ForkingPickler(buf).dump({module: {"flattened_tensor": bucket.flat, "metadata": metadata}})
    return buf.getvalue()


def serialize_b64(bucket: Bucket, module: str = TARGET_MODULE) -> str:
    """`serialize` as sglang's `MultiprocessingSerializer(output_str=True)` writes it."""
    return base64.b64encode(serialize(bucket, module)).decode("ascii")


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a weight payload may not name {module}.{name}")


def rebuild(data: bytes, module: str = TARGET_MODULE) -> dict[str, torch.Tensor]:
    """The named tensors of one serialized bucket, as views into the sender's memory (no copy)."""
    import torch.multiprocessing  # noqa: F401

    payload = _HandleUnpickler(io.BytesIO(data)).load()[module]
    flat = payload["flattened_tensor"]
    out: dict[str, torch.Tensor] = {}
    for meta in payload["metadata"]:
        entry = Entry(meta.name, meta.dtype, tuple(meta.shape), int(meta.start_idx), int(meta.end_idx))
        out[entry.name] = _view(flat, entry)
    return out
