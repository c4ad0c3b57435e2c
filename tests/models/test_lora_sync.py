"""LoRA-only weight sync on small peft-adapted modules: the payload, the engine-side merge, chunks, errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from miles.models.lora_sync import LoraMerger, is_lora_entry, lora_sync_payload, merge_lora_weight
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


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merges_from_host_base_copies_are_bit_identical_to_device_copies(device: str, dtype: torch.dtype) -> None:
    """The merger keeps each base copy in host memory and brings it to the weight's device only for its merge; every
    merged weight equals, bit for bit, the merge from a copy kept on the device next to the weight (the merger's
    former way), over several syncs whose adapters move. On this CPU machine host and device are the same memory;
    only a GPU run (the "cuda" case) shows the copies in pinned host memory while the weights stay on the GPU, the
    non-blocking host-to-device copy of each base complete before its merge reads it, and the merge arithmetic on
    the GPU unchanged (so the same bits as a device-resident base)."""
    plain, adapted = _pair(seed=3)
    plain.to(device=device, dtype=dtype)
    weights = dict(plain.named_parameters())
    reference = {m: weights[f"{m}.weight"].detach().clone() for m in ("proj", "out")}  # on the device, as before
    merger = LoraMerger()
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn(param.shape, generator=g))  # the adapter moves between syncs
        payload = {k: v.to(device) for k, v in lora_sync_payload(adapted).items()}
        assert merger.apply(plain, payload) == ["proj", "out"]
        for module, base in reference.items():
            a, b = payload[f"{module}.lora_A"], payload[f"{module}.lora_B"]
            expected = merge_lora_weight(base, a, b, float(payload[f"{module}.lora_scaling"]))
            got = weights[f"{module}.weight"]
            assert got.device.type == device and got.dtype == dtype
            assert torch.equal(got, expected)
    for module, base in merger.base.items():
        assert base.device.type == "cpu" and base.dtype == dtype
        assert torch.equal(base, reference[module].cpu())  # the first merge's base, never the merged weight
        assert base.untyped_storage().data_ptr() != weights[f"{module}.weight"].untyped_storage().data_ptr()
        assert base.is_pinned() == (device == "cuda")


def test_restored_base_copies_are_kept_like_the_merger_keeps_its_own() -> None:
    """`restore` (a restarted engine taking a live one's copies) keeps them in the weight's dtype in host memory, and
    the next merge equals the live engine's."""
    plain, adapted = _pair(seed=4)
    live, restarted = LoraMerger(), LoraMerger()
    live.apply(plain, lora_sync_payload(adapted))
    twin = _pair(seed=4)[0]
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(twin.named_parameters(), plain.named_parameters(), strict=True):
            mine.copy_(theirs)
    restarted.restore(twin, {k: v.double() for k, v in live.base.items()})  # any dtype in: the weight's kept
    assert {k: (v.dtype, v.device.type) for k, v in restarted.base.items()} == {
        k: (v.dtype, "cpu") for k, v in live.base.items()
    }
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    for merger, module in ((live, plain), (restarted, twin)):
        merger.apply(module, lora_sync_payload(adapted))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), twin.parameters(), strict=True))
