"""Which dtype each tensor of a module gets from its library's `from_pretrained(dtype=D)`, read off a module built
on the meta device under a half default dtype (`meta_build`).

diffusers (`ModelMixin.from_pretrained`): the model is built with the default dtype set to D; every floating tensor
of the checkpoint (parameters and persistent buffers) is then cast to D, except those in `_keep_in_fp32_modules`
(a module name equal to one part of the tensor's dotted name), which load in fp32. transformers
(`PreTrainedModel.from_pretrained`): the same construction; a checkpoint tensor keeps the dtype the constructor gave
it unless it matches the dtype plan (`_keep_in_fp32_modules` for fp16, `_keep_in_fp32_modules_strict` for fp16 and
bf16, matched as regular expressions searched in the name, as transformers does), which loads it in fp32.
Non-persistent buffers are never loaded: they keep the constructor's dtype.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from miles.memory.counts import BUFFER, LOCAL_BUFFER, PARAM, TensorGroup

BUILD_DTYPE = torch.bfloat16  # the default dtype of the meta build: a tensor made in any other dtype is "fixed"


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _diffusers_pin(module: Any) -> dict[str, str]:
    keep = getattr(type(module), "_keep_in_fp32_modules", None) or []
    return dict.fromkeys(keep if isinstance(keep, list | tuple | set) else [keep], "half")


def _transformers_patterns(module: Any) -> list[tuple[re.Pattern[str], str]]:
    """(pattern, pin) of the model's dtype plans: strict ones pin at fp16 and bf16, the others at fp16 only."""
    out = []
    for attr, pin in (("_keep_in_fp32_modules_strict", "half"), ("_keep_in_fp32_modules", "fp16")):
        for name in sorted(getattr(module, attr, None) or ()):
            out.append((re.compile(str(name).replace("*", ".*")), pin))
    return out


def pin_of(name: str, library: str, module: Any, cache: dict[str, Any]) -> str:
    """The fp32 pin of checkpoint tensor `name` of `module` ("half", "fp16" or "")."""
    if library == "diffusers":
        keep = cache.setdefault("diffusers", _diffusers_pin(module))
        return "half" if any(part in keep for part in name.split(".")) else ""
    patterns = cache.setdefault("transformers", _transformers_patterns(module))
    pins = {pin for pattern, pin in patterns if pattern.search(name)}
    return "half" if "half" in pins else ("fp16" if pins else "")


def _made(tensor: torch.Tensor) -> str:
    return "" if tensor.dtype == BUILD_DTYPE else dtype_str(tensor.dtype)


def tensor_groups(module: torch.nn.Module, library: str) -> tuple[TensorGroup, ...]:
    """The module's parameters (shared ones once) and buffers as `TensorGroup`s, in a stable order."""
    cache: dict[str, Any] = {}
    counts: dict[tuple[int, int, str, str, str], int] = {}

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        dim0 = int(tensor.shape[0]) if tensor.dim() else 1
        rest = tensor.numel() // dim0 if dim0 else 0
        pin = "" if kind == LOCAL_BUFFER else pin_of(name, library, module, cache)
        key = (dim0, rest, kind, _made(tensor), pin)
        counts[key] = counts.get(key, 0) + 1

    for name, param in module.named_parameters():
        add(name, param, PARAM)
    for name, buffer in named_buffers(module):
        add(name, buffer[0], BUFFER if buffer[1] else LOCAL_BUFFER)
    return tuple(
        TensorGroup(dim0, rest, count, kind, made, pin)
        for (dim0, rest, kind, made, pin), count in sorted(counts.items(), key=lambda kv: (kv[0][2], kv[0]))
    )


def named_buffers(module: torch.nn.Module) -> list[tuple[str, tuple[torch.Tensor, bool]]]:
    """(name, (buffer, persistent)) of every buffer, shared ones once."""
    seen: set[int] = set()
    out = []
    for prefix, sub in module.named_modules():
        for key, buffer in sub._buffers.items():
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            name = f"{prefix}.{key}" if prefix else key
            out.append((name, (buffer, key not in sub._non_persistent_buffers_set)))
    return out


def apply_load_dtype(module: torch.nn.Module, library: str, dtype: torch.dtype) -> torch.nn.Module:
    """Give every tensor of a meta-built `module` the dtype `from_pretrained(dtype=dtype)` would (module is
    changed in place and returned)."""
    cache: dict[str, Any] = {}
    load = dtype_str(dtype)
    with torch.no_grad():
        for name, param in module.named_parameters():
            group = TensorGroup(1, 1, 1, PARAM, _made(param), pin_of(name, library, module, cache))
            target = getattr(torch, group.dtype_at(library, load))
            if param.dtype != target:
                param.data = param.data.to(target)
        for prefix, sub in module.named_modules():
            for key, buffer in list(sub._buffers.items()):
                if buffer is None:
                    continue
                persistent = key not in sub._non_persistent_buffers_set
                name = f"{prefix}.{key}" if prefix else key
                pin = pin_of(name, library, module, cache) if persistent else ""
                group = TensorGroup(1, 1, 1, BUFFER if persistent else LOCAL_BUFFER, _made(buffer), pin)
                target = getattr(torch, group.dtype_at(library, load))
                if buffer.dtype != target:
                    sub._buffers[key] = buffer.to(target)
    return module
