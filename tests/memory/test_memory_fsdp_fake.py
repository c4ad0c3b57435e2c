"""The FSDP2 wrap of every real-size denoiser, as the trainer wraps it (`miles.training.model.shard` with the
family's block lists, after LoRA), on 8 fake ranks (torch's fake process group; the meta device, so nothing is
allocated). Each rank's local shards are the chunks of dim 0 the arithmetic predicts: rank 0's, the largest, is
the padded shard every rank allocates, and the chunks of all ranks add up to the model exactly (total / 8 plus the
padding of the dims that 8 does not divide)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles.config.resolution import schema_args
from miles.memory.cache import cached_counts
from miles.memory.meta_build import LoraSpec, build_denoiser
from miles.memory.shipped import shipped_models
from miles.memory.static import Denoiser

WORLD = 8
RANK = 32
MODELS = sorted(shipped_models().items(), key=lambda kv: kv[0].name)
BIGGEST = ("LTX-2", "Wan2.2-T2V-A14B-Diffusers", "Qwen-Image")  # 9-18 s each on 2 cores: extended
CASES = [
    pytest.param(d, m, id=d.name, marks=[pytest.mark.slow, *([pytest.mark.extended] if d.name in BIGGEST else [])])
    for d, m in MODELS
]


def _chunk(dim0: int, rank: int) -> int:
    """Rows of dim 0 on `rank` (torch.chunk over WORLD ranks, as FSDP2 shards)."""
    size = math.ceil(dim0 / WORLD)
    return max(0, min(size, dim0 - rank * size))


def _shard_on(model: torch.nn.Module, family, rank: int) -> tuple[int, int, int]:
    """(local shard elements, padded shard elements, FSDP modules) of `model` wrapped on fake rank `rank`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from miles.training.model import shard

    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        args = schema_args(
            diffusion_forward_dtype="bf16", fsdp_master_dtype="fp32", fsdp_reduce_dtype="fp32", fsdp_cpu_offload=False
        )
        shard(model, args, mesh, family.fsdp_block_lists)
        local = sum(p._local_tensor.numel() for p in model.parameters())
        wrapped = [m for m in model.modules() if isinstance(m, FSDPModule)]
        padded = 0
        for module in wrapped:
            group = module._get_fsdp_state()._fsdp_param_group
            padded += sum(fp._sharded_param_data.numel() for fp in group.fsdp_params) if group else 0
        return local, padded, len(wrapped)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("config_dir,model", CASES)
def test_fsdp2_wrap_on_8_fake_ranks(config_dir: Path, model) -> None:
    from miles.training.model import submodules

    family = model.family
    lora = LoraSpec(RANK, 2 * RANK, tuple(family.lora_target_modules))
    built = build_denoiser(config_dir, family, model.components, torch.float32, lora)
    shapes = [(p.shape[0] if p.dim() else 1, p.numel()) for p in built.parameters()]
    total = sum(n for _, n in shapes)
    blocks = sum(len(submodules(built, path)) for path in family.fsdp_block_lists)
    assert blocks > 0 and all(submodules(built, path) for path in family.fsdp_block_lists)
    expected = {r: sum(_chunk(d0, r) * (n // d0) for d0, n in shapes) for r in range(WORLD)}
    assert sum(expected.values()) == total  # the chunks of all ranks are the model, exactly
    for rank in (0, WORLD - 1):
        local, padded, wrapped = _shard_on(copy.deepcopy(built), family, rank)
        assert wrapped == blocks + 1  # every block of the family's lists, and the root
        assert local == expected[rank]
        assert padded == expected[0]  # every rank allocates rank 0's (padded) size
    padding = WORLD * expected[0] - total
    assert 0 <= padding <= sum((WORLD - 1) * (n // d0) for d0, n in shapes if d0 % WORLD)
    # the torch-free arithmetic the estimate uses gives the same rank-0 shard
    counts = cached_counts(config_dir)
    tensors = tuple((counts.components[c].library, g) for c in model.components for g in counts.components[c].tensors)
    adapters = counts.adapters(model.components, lora.targets)
    arithmetic = Denoiser(tensors, adapters, RANK, "float32")
    assert arithmetic.sharded_bytes(WORLD, "base") + arithmetic.sharded_bytes(WORLD, "adapters") == 4 * expected[0]
