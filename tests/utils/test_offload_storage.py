"""`miles.utils.offload`: storages leave the device and come back bit for bit, with bytes counted."""

from __future__ import annotations

import numpy as np
import torch

from miles.utils.offload import Offloader, module_tensors, optimizer_tensors, own_memory


def _trained_module() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 32)).square().sum().backward()
    optimizer.step()
    return module, optimizer


def test_round_trip_frees_the_storages_and_restores_every_byte() -> None:
    module, optimizer = _trained_module()
    params = {k: v.clone() for k, v in module.state_dict().items()}
    state = [t.clone() for t in optimizer_tensors(optimizer)]
    offloader = Offloader("cpu")
    moved = offloader.offload(module_tensors([module]) + optimizer_tensors(optimizer))
    expected = sum(t.numel() * t.element_size() for t in [*params.values(), *state])
    assert moved.bytes == expected == offloader.offloaded_bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    assert all(t.untyped_storage().nbytes() == 0 for t in optimizer_tensors(optimizer))
    back = offloader.onload()
    assert back.bytes == expected and offloader.offloaded_bytes == 0
    assert all(torch.equal(params[k], v) for k, v in module.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(state, optimizer_tensors(optimizer), strict=True))


def test_training_after_a_round_trip_equals_training_without_one() -> None:
    runs = []
    for offload in (False, True):
        module, optimizer = _trained_module()
        if offload:
            offloader = Offloader("cpu")
            offloader.offload(module_tensors([module]) + optimizer_tensors(optimizer))
            offloader.onload()
        torch.manual_seed(1)
        module(torch.randn(4, 32)).square().sum().backward()
        optimizer.step()
        runs.append(module.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_each_storage_moves_once_and_offload_calls_accumulate() -> None:
    module, optimizer = _trained_module()
    weight = module[0].weight
    offloader = Offloader("cpu")
    first = offloader.offload([weight, weight.view(-1), weight[:4]])  # three views, one storage
    assert first.bytes == weight.numel() * 4
    second = offloader.offload(optimizer_tensors(optimizer))
    assert offloader.offloaded_bytes == first.bytes + second.bytes
    assert offloader.onload().bytes == first.bytes + second.bytes


def test_memory_torch_did_not_allocate_is_made_torch_own() -> None:
    array = np.arange(8, dtype=np.float32)
    module = torch.nn.Module()
    module.register_buffer("table", torch.from_numpy(array))
    assert not module.table.untyped_storage().resizable()
    assert own_memory([module]) == 1
    assert module.table.untyped_storage().resizable()
    array[0] = 100.0  # the buffer no longer aliases the numpy array
    offloader = Offloader("cpu")
    assert offloader.offload(module_tensors([module])).bytes == 32
    offloader.onload()
    assert module.table.tolist() == list(range(8))


def test_own_memory_aligns_a_tensor_at_an_odd_offset() -> None:
    # a safetensors mmap places tensors at any byte offset: 4 bytes into a numpy buffer (numpy aligns to 16)
    weight = torch.from_numpy(np.arange(17, dtype=np.float32)[1:]).view(4, 4)
    module = torch.nn.Linear(4, 4, bias=False)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert module.weight.data_ptr() % 64 != 0
    assert own_memory([module]) == 1
    assert module.weight.data_ptr() % 64 == 0  # CPU GEMM kernels take the aligned path, as on the trainer's copy
    assert module.weight.flatten().tolist() == list(range(1, 17))


def test_foreign_memory_shared_by_two_tensors_stays() -> None:
    base = torch.from_numpy(np.ones(8, dtype=np.float32))
    halves = [base[:4], base[4:]]
    offloader = Offloader("cpu")
    assert offloader.offload(halves).bytes == 0  # cannot be freed without breaking the sharing
    assert halves[0].sum().item() == 4.0
