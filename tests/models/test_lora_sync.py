"""LoRA-only weight sync on small peft-adapted modules: the payload, the engine-side merge, chunks, errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from miles.models.lora_sync import LoraMerger, is_lora_entry, lora_sync_payload
from miles.utils.buckets import chunk_state_dict


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(plain copy, LoRA-adapted model) of one small two-layer module; B is random so the adapter matters."""
    torch.manual_seed(seed)
    plain = nn.Sequential(OrderedDict(proj=nn.Linear(6, 5), out=nn.Linear(5, 3)))
    adapted = inject_adapter_in_model(
        LoraConfig(r=2, lora_alpha=6, target_modules=["proj", "out"], init_lora_weights="gaussian"),
        nn.Sequential(OrderedDict(proj=nn.Linear(6, 5), out=nn.Linear(5, 3))),
    )
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" not in name:
                param.copy_(plain.state_dict()[name.replace(".base_layer.", ".")])
            elif "lora_B" in name:
                param.normal_()
    return plain, adapted


def _same_function(a: nn.Module, b: nn.Module) -> bool:
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.allclose(a(x), b(x), atol=1e-6)


def test_the_payload_is_the_adapter_and_merging_it_gives_the_adapted_function() -> None:
    plain, adapted = _pair()
    payload = lora_sync_payload(adapted)
    assert sorted(payload) == [f"{m}.{p}" for m in ("out", "proj") for p in ("lora_A", "lora_B", "lora_scaling")]
    assert all(is_lora_entry(k) for k in payload) and float(payload["proj.lora_scaling"]) == 3.0  # alpha / r
    assert not _same_function(plain, adapted)
    assert LoraMerger().apply(plain, payload) == ["proj", "out"]
    assert _same_function(plain, adapted)


def test_repeated_syncs_do_not_compound_and_a_module_may_span_chunks() -> None:
    plain, adapted = _pair()
    merger = LoraMerger()
    chunks = chunk_state_dict(lora_sync_payload(adapted), 16)  # every tensor alone: a module spans 3 chunks
    assert len(chunks) == 6
    assert merger.apply(plain, chunks[0]) == [] and merger.pending  # A alone: nothing merged yet
    for chunk in chunks[1:]:
        merger.apply(plain, chunk)
    assert not merger.pending
    for _ in range(3):
        merger.apply(plain, lora_sync_payload(adapted))
    assert _same_function(plain, adapted)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(-2.0)  # the adapter moves on: the next sync replaces, never adds
    merger.apply(plain, lora_sync_payload(adapted))
    assert _same_function(plain, adapted)


def test_a_full_weight_update_becomes_the_new_base() -> None:
    plain, adapted = _pair()
    original = plain.proj.weight.detach().clone()
    merger = LoraMerger()
    merger.apply(plain, lora_sync_payload(adapted))
    with torch.no_grad():
        plain.proj.weight.copy_(original)  # what an engine does with a full update ...
    merger.forget(["proj.weight", "proj.bias"])  # ... and then tells the merger
    assert "proj" not in merger.base and "out" in merger.base
    merger.apply(plain, lora_sync_payload(adapted))
    assert _same_function(plain, adapted)


def test_errors_name_the_module() -> None:
    plain, adapted = _pair()
    payload = lora_sync_payload(adapted)
    with pytest.raises(KeyError, match="no module 'missing'"):
        LoraMerger().apply(plain, {"missing.lora_A": payload["proj.lora_A"]})
    wrong = {**payload, "proj.lora_A": payload["out.lora_A"]}
    with pytest.raises(ValueError, match=r"LoRA shapes do not fit: weight \(5, 6\)"):
        LoraMerger().apply(plain, wrong)
