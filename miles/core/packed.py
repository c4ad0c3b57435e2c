"""Many small tensors through pickle (Ray's object store) as a few large ones.

A rollout is hundreds of samples, each with a handful of small tensors (latents, log-probs, timesteps, image,
conditions). Plain pickling writes every tensor's storage on its own (a `torch.save` per storage on each side),
which for the tiny job's 960 samples cost seconds an iteration across the engine -> manager -> driver -> trainer
hops (issue 46). `Packed(obj)` pickles as `obj` itself: its plain CPU tensors are taken out, stacked by dtype
and shape into one tensor per group, and put back on the other side as tensors of their own (each with its own
storage, so pickling one later does not drag the whole group along). A tensor met twice (e.g. the conditions
every sample of a request shares) stays one tensor. Anything else (tensor subclasses such as parameters, tensors
on a GPU, tensors that need grad) pickles as usual.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


class Packed:
    """Pickles as `obj` (`pickle.loads` returns the object, not this wrapper). The packing happens here, on the
    thread that makes it: an engine packs on its compute thread (`miles.utils.compute_thread`), not on the Ray
    thread that sends the result, whose torch work would start a second OpenMP pool in the process."""

    __slots__ = ("reduced",)

    def __init__(self, obj: Any) -> None:
        try:
            self.reduced: tuple[Any, tuple[Any, ...]] = (_unpack, pack(obj))
        except (pickle.PicklingError, TypeError, AttributeError):  # e.g. a local function: pickled as usual
            self.reduced = (_same, (obj,))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.reduced


def _same(obj: Any) -> Any:
    return obj


def _packable(obj: Any) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and not obj.is_quantized
    )


def pack(obj: Any) -> tuple[bytes, list[tuple[Any, str, tuple[int, ...]]], list[tuple[int, int]]]:
    """(`obj` pickled with its tensors as references, the stacked groups, each reference's (group, row))."""
    index_of: dict[int, int] = {}  # id(tensor) -> reference
    tensors: list[torch.Tensor] = []

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> int | None:
            if not _packable(o):
                return None
            ref = index_of.get(id(o))
            if ref is None:
                ref = index_of[id(o)] = len(tensors)
                tensors.append(o)
            return ref

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    group_of: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
    members: list[list[torch.Tensor]] = []
    where: list[tuple[int, int]] = []
    for t in tensors:
        key = (t.dtype, tuple(t.shape))
        g = group_of.setdefault(key, len(members))
        if g == len(members):
            members.append([])
        where.append((g, len(members[g])))
        members[g].append(t)
    groups = [_as_bytes(torch.stack(m)) for m in members]
    return buffer.getvalue(), groups, where


def _as_bytes(t: torch.Tensor) -> tuple[Any, str, tuple[int, ...]]:
    """A stacked group as (its bytes as a numpy uint8 array, dtype name, shape). numpy arrays travel through
    pickle protocol 5 out of band: Ray writes them into its object store and reads them back without the copy
    `torch.save` makes of a tensor's storage on each side (0.07 s a rollout of the tiny job)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _from_bytes(data: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The group, read in place (the rows are cloned out of it); the object store's buffer is read-only, which
    torch warns about once: nothing writes to it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _unpack(data: bytes, groups: list[tuple[Any, str, tuple[int, ...]]], where: list[tuple[int, int]]) -> Any:
    rows = [list(_from_bytes(*g).unbind(0)) for g in groups]
    tensors = [rows[g][r].clone() for g, r in where]

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> torch.Tensor:
            return tensors[int(pid)]

    return _Unpickler(io.BytesIO(data)).load()
