"""Fast checks of the parallel layout: the backend a rank picks, the all-to-all layouts on simulated ranks, the
collectives' adjoints on a real 1-rank gloo group, and the name lists against the installed torch and diffusers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from trainer_helpers import free_port

from miles.config.args import Args
from miles.config.backends import ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS
from miles.core.errors import ConfigError
from miles.models import ulysses
from miles.training.parallel import ParallelLayout, check_attention_backend_device, check_sizes, process_group_backend


def backend_args(offload: bool = False, **explicit: str) -> Args:
    values: dict[str, Any] = {"distributed_backend": "nccl", "fsdp_cpu_backend": "gloo", "fsdp_cpu_offload": offload}
    sources = dict.fromkeys(values, "default")
    for dest, value in explicit.items():
        values[dest], sources[dest] = value, "cli"
    return Args(values, sources, "rl")


# ---- the process-group backend, decided inside the rank --------------------------------------------------


def test_gpu_rank_uses_the_distributed_backend_and_the_hybrid_under_offload() -> None:
    assert process_group_backend(backend_args(), cuda=True) == "nccl"
    assert process_group_backend(backend_args(offload=True), cuda=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(backend_args(offload=True, fsdp_cpu_backend="mpi"), cuda=True) == "cpu:mpi,cuda:nccl"


def test_cpu_rank_uses_the_fsdp_cpu_backend() -> None:
    assert process_group_backend(backend_args(), cuda=False) == "gloo"  # the default nccl means gloo here
    assert process_group_backend(backend_args(fsdp_cpu_backend="mpi"), cuda=False) == "mpi"
    assert process_group_backend(backend_args(distributed_backend="gloo"), cuda=False) == "gloo"  # the CPU recipes


def test_cpu_rank_refuses_an_explicit_cuda_backend() -> None:
    with pytest.raises(ConfigError) as err:
        process_group_backend(backend_args(distributed_backend="nccl"), cuda=False)
    assert str(err.value) == (
        "--distributed-backend nccl (cli) needs CUDA, and this trainer rank has none; use --distributed-backend gloo "
        "(a CPU-only rank's process group runs on --fsdp-cpu-backend)"
    )


def test_cpu_rank_refuses_contradicting_backends() -> None:
    with pytest.raises(ConfigError, match=r"--distributed-backend mpi \(cli\) contradicts --fsdp-cpu-backend gloo"):
        process_group_backend(backend_args(distributed_backend="mpi"), cuda=False)


def test_cuda_only_attention_backends_are_refused_on_a_cpu_rank() -> None:
    for name in ("native", "_native_math"):
        check_attention_backend_device(name, cuda=False)
    check_attention_backend_device("flash", cuda=True)
    with pytest.raises(ConfigError) as err:
        check_attention_backend_device("flash", cuda=False)
    assert str(err.value) == (
        "--fsdp-attention-backend flash needs CUDA, and this trainer rank has none; on the CPU use one of native, "
        "_native_math"
    )
    for name in ("_native_cudnn", "_native_efficient", "_native_flash", "sage", "xformers", "flex"):
        with pytest.raises(ConfigError, match=f"--fsdp-attention-backend {name} needs CUDA"):
            check_attention_backend_device(name, cuda=False)


def test_name_lists_match_torch_and_diffusers() -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    torch_backends = set(dist.Backend.backend_list) - {"undefined", "fake"}
    assert set(DISTRIBUTED_BACKENDS) == torch_backends
    for name, devices in DISTRIBUTED_BACKENDS.items():
        assert set(devices) <= set(dist.Backend.backend_capability[name]), name
    assert set(ATTENTION_BACKENDS) == {b.value for b in AttentionBackendName}


# ---- the layout ---------------------------------------------------------------------------------------


def test_layout_ranks_and_sizes() -> None:
    ranks = [ParallelLayout(r, 8, 2, 2) for r in range(8)]
    assert [(x.dp_rank, x.sp_rank) for x in ranks] == [(r // 2, r % 2) for r in range(8)]
    assert {x.dp_size for x in ranks} == {4}
    check_sizes(8, 2, 2)
    with pytest.raises(ConfigError, match="--sequence-parallel-size 3 must divide the train world size 8"):
        check_sizes(8, 3, 1)
    with pytest.raises(
        ConfigError, match=r"--dp-replicate-size 4 must divide dp_size 2 \(= train world size 8 / sp 4\)"
    ):
        check_sizes(8, 4, 4)


def simulated_all_to_all(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """What all_to_all_single does over len(sends) ranks: rank j receives chunk j of every rank, in rank order."""
    return [torch.stack([send[j] for send in sends]) for j in range(len(sends))]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_to_all_layouts_on_simulated_ranks(world: int) -> None:
    full = torch.randn(2, 16, 4, 3)  # [B, N, H, D]
    n, h = 16 // world, 4 // world
    local = [full[:, r * n : (r + 1) * n] for r in range(world)]
    by_heads = [
        ulysses.from_recv_by_heads(recv)
        for recv in simulated_all_to_all([ulysses.to_send_by_heads(x, world) for x in local])
    ]
    for r in range(world):  # every token, this rank's heads
        assert torch.equal(by_heads[r], full[:, :, r * h : (r + 1) * h])
    back = [
        ulysses.from_recv_by_tokens(recv)
        for recv in simulated_all_to_all([ulysses.to_send_by_tokens(x, world) for x in by_heads])
    ]
    for r in range(world):
        assert torch.equal(back[r], local[r])


# ---- the collectives on a real 1-rank gloo group ------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group() -> Any:
    if not dist.is_initialized():
        import os

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        dist.init_process_group("gloo", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a 1-rank process group")
    return dist.group.WORLD


def test_collectives_take_gradients_of_any_layout(one_rank_group: Any) -> None:
    """The backward gets a gradient with whatever strides autograd hands it; the result must follow the values."""
    x = torch.randn(2, 8, 4, 3, requires_grad=True)
    weight = torch.randn(2, 4, 8, 3).transpose(1, 2)  # non-contiguous: so is the gradient reaching the collective
    for fn in (ulysses.tokens_to_heads, ulysses.heads_to_tokens):
        x.grad = None
        y = fn(x, one_rank_group)
        assert torch.equal(y, x)
        (y * weight).sum().backward()
        assert torch.equal(x.grad, weight)
    x.grad = None
    y = ulysses.gather(x, 2, one_rank_group)
    (y * weight).sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, weight)
    assert torch.equal(ulysses.local_chunk(x, 1, one_rank_group), x)
