"""--update-weight-buffer-size on sglang engines: a full-weight sync is written in shards of at most that many
bytes (diffusers' sharded layout with its index), which `/update_weights_from_disk` loads one file at a time.
On tiny-sd3's real transformer state dict (1.2 MB in fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.rollout.engines.sglang.sync import WEIGHTS_FILE, shard_plan, write_expert_weights, write_transformer

pytestmark = pytest.mark.slow  # needs the tiny-sd3 build (the test itself takes well under a second)

KIB = 1024


@pytest.fixture(scope="module")
def state(tiny_sd3_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_sd3_dir / "transformer" / WEIGHTS_FILE))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(
    ("buffer", "dtype", "shards"), [(256 * KIB, torch.bfloat16, 3), (128 * KIB, torch.float32, 14)]
)
def test_shards_hold_at_most_the_buffer_and_load_back_bit_for_bit(
    state: dict[str, torch.Tensor], tmp_path: Path, buffer: int, dtype: torch.dtype, shards: int
) -> None:
    """The sglang disk sync at --update-weight-buffer-size `buffer` (`SglangRollout.update_weights` passes it)."""
    assert sum(t.numel() for t in state.values()) == 304_784  # tiny-sd3's transformer: 595 KiB in bf16
    total = 304_784 * dtype.itemsize
    path = write_transformer(state, tmp_path, 1, dtype, buffer)
    folder = path / "transformer"
    files = sorted(folder.glob("*.safetensors"))
    assert [f.name for f in files] == [
        f"diffusion_pytorch_model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)
    ]
    index = json.loads((folder / f"{WEIGHTS_FILE}.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(state)
    loaded = [load_file(str(f)) for f in files]
    for k, part in enumerate(loaded):
        assert _nbytes(part) <= buffer or len(part) == 1  # a tensor larger than the buffer goes alone
        assert all(index["weight_map"][name] == files[k].name for name in part)
        if k + 1 < len(loaded):  # greedy: the next shard's first tensor did not fit into this one
            first = next(iter(loaded[k + 1].values()))
            assert _nbytes(part) + first.numel() * first.element_size() > buffer
    merged = {name: t for part in loaded for name, t in part.items()}
    assert list(merged) == [n for part in shard_plan(state, dtype, buffer) for n in part]
    assert all(torch.equal(merged[name], t.to(dtype)) for name, t in state.items())


def test_a_sync_within_the_buffer_is_one_file(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    folder = write_transformer(state, tmp_path, 2, torch.bfloat16, 512 * 1024 * KIB) / "transformer"
    assert [p.name for p in folder.iterdir()] == [WEIGHTS_FILE]
    assert len(shard_plan(state, torch.bfloat16, None)) == 1


def test_a_tensor_larger_than_the_buffer_is_a_shard_alone(state: dict[str, torch.Tensor]) -> None:
    plan = shard_plan(state, torch.float32, 1)
    assert [len(names) for names in plan] == [1] * len(state)


def test_experts_are_sharded_per_module(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    experts = {f"{t}.{name}": tensor for t in ("transformer", "transformer_2") for name, tensor in state.items()}
    path, targets = write_expert_weights(
        experts, tmp_path, 3, torch.bfloat16, ("transformer", "transformer_2"), 256 * KIB
    )
    assert targets == ("transformer", "transformer_2")
    for target in targets:
        assert len(list((path / target).glob("*.safetensors"))) == 3
        assert (path / target / f"{WEIGHTS_FILE}.index.json").is_file()
