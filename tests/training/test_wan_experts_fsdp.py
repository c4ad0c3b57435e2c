"""Wan2.2's experts under FSDP2 on 2 gloo ranks whose micro-batches hold different denoising phases.

Rank 0's rows are all high-noise (only `transformer` has work), rank 1's all low-noise (only `transformer_2`):
`WanExperts` still runs both experts on both ranks (an idle expert on one dummy row, times zero), so every
rank reaches the same FSDP collectives; the step completes and the averaged gradients equal one process's
gradients of the same loss on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import free_port

pytestmark = pytest.mark.slow

BOUNDARY = 875.0


def _experts():
    from diffusers import WanTransformer3DModel

    from miles.models.wan2_2.experts import WanExperts

    def one(seed: int):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=1,
            rope_max_seq_len=32,
        )

    return WanExperts({"transformer": one(1), "transformer_2": one(2)}, BOUNDARY)


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 2, 4, 4, generator=g)
    text = torch.randn(4, 5, 16, generator=g)
    t = torch.tensor([990.0, 900.0, 500.0, 100.0])  # rows 0-1 high noise, rows 2-3 low noise
    return x, t, text


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _experts()
        for expert in (model.transformer, model.transformer_2):
            for block in expert.blocks:
                fully_shard(block)
        fully_shard(model)
        x, t, text = _batch()
        rows = slice(0, 2) if rank == 0 else slice(2, 4)  # one phase per rank
        out = model(x[rows], t[rows], text[rows])[0]
        out.square().mean().backward()  # FSDP averages the gradients over the ranks
        grads = _grads(model)
        if rank == 0:
            queue.put({k: v.numpy() for k, v in grads.items()})
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_phases_train_both_experts_in_step() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = queue.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    model = _experts()
    x, t, text = _batch()
    # one process, the whole batch: each half's loss as its rank computed it, averaged over the two ranks
    out = model(x, t, text)[0]
    ((out[:2].square().mean() + out[2:].square().mean()) / 2).backward()
    want = _grads(model)
    assert set(got) == set(want) and any(k.startswith("transformer_2.") for k in got)
    for name, grad in want.items():
        assert torch.allclose(torch.from_numpy(got[name]), grad, atol=1e-6, rtol=1e-5), name
