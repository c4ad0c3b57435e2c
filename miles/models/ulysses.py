"""Ulysses sequence parallelism: the collectives that move a DiT's tokens between ranks, with exact gradients.

The ranks of one sequence-parallel (SP) group each hold a contiguous slice of every sample's image
tokens. Attention needs every token, so around it an all-to-all swaps the slice of tokens (all heads)
for all tokens of a slice of the heads, and back afterwards. Layouts are diffusers' attention layout
[batch, tokens, heads, head_dim].

Gradients follow one convention: a rank's parameter gradient is its partial sum and the whole
gradient is the sum over the ranks. Every collective here is an autograd function whose backward is
the exact adjoint of its forward (all-to-all <-> the same all-to-all; all-gather <-> reduce-scatter;
taking a rank's slice <-> zero-filling the rest), so summing the ranks' gradients gives the gradient
of the sum of the ranks' losses.

The layout functions (`to_send_by_heads`, `from_recv_by_heads`, `to_send_by_tokens`,
`from_recv_by_tokens`) are pure tensor reshapes, tested on a simulated all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# ---- layouts around the all-to-all (pure; chunk j of a send buffer goes to rank j) ----------------


def to_send_by_heads(x: torch.Tensor, world: int) -> torch.Tensor:
    """[B, N_local, H, D] -> [world, B, N_local, H / world, D]: chunk j holds the heads rank j attends."""
    b, n, h, d = x.shape
    return x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()


def from_recv_by_heads(recv: torch.Tensor) -> torch.Tensor:
    """[world, B, N_local, H_local, D] (chunk i: rank i's tokens) -> [B, world * N_local, H_local, D]."""
    world, b, n, h, d = recv.shape
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * n, h, d)


def to_send_by_tokens(x: torch.Tensor, world: int) -> torch.Tensor:
    """[B, N, H_local, D] -> [world, B, N / world, H_local, D]: chunk j holds rank j's tokens."""
    b, n, h, d = x.shape
    return x.reshape(b, world, n // world, h, d).permute(1, 0, 2, 3, 4).contiguous()


def from_recv_by_tokens(recv: torch.Tensor) -> torch.Tensor:
    """[world, B, N_local, H_local, D] (chunk i: rank i's heads) -> [B, N_local, world * H_local, D]."""
    world, b, n, h, d = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, world * h, d)


# ---- autograd-aware collectives -----------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()  # first: a gradient may arrive with any strides, and `out` must be dense like `x`
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _all_gather_stacked(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[*] -> [world, *]: every rank's `x`, in rank order."""
    world = dist.get_world_size(group)
    flat = x.reshape(-1)
    out = flat.new_empty(world * flat.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat.contiguous(), group=group)
    return out.view(world, *x.shape)


def _reduce_scatter_stacked(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[world, *] -> [*]: chunk `rank` summed over the ranks."""
    out = x.new_empty(x[0].numel())
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.reshape(-1).contiguous(), group=group)
    return out.view(x.shape[1:])


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; the backward is the same exchange (it is its own adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """All-gather along `dim` (rank order); the backward sums the gradient over the ranks and keeps this
    rank's chunk (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = _all_gather_stacked(x, group)
        return torch.cat(parts.unbind(0), dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        world = dist.get_world_size(ctx.group)
        stacked = torch.stack(grad.chunk(world, dim=ctx.dim))
        return _reduce_scatter_stacked(stacked, ctx.group), None, None


# ---- what a model calls -------------------------------------------------------------------------


def group_rank_size(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def tokens_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-sharded [B, N / sp, H, D] -> head-sharded [B, N, H / sp, D] (all-to-all)."""
    world = dist.get_world_size(group)
    return from_recv_by_heads(_AllToAll.apply(to_send_by_heads(x, world), group))


def heads_to_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Head-sharded [B, N, H / sp, D] -> sequence-sharded [B, N / sp, H, D] (all-to-all)."""
    world = dist.get_world_size(group)
    return from_recv_by_tokens(_AllToAll.apply(to_send_by_tokens(x, world), group))


def gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order; gradient: reduce-scatter."""
    return _Gather.apply(x, dim, group)


def local_chunk(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's contiguous chunk of a tensor every rank of `group` holds whole (a local slice)."""
    rank, world = group_rank_size(group)
    size = x.shape[dim] // world
    return x.narrow(dim, rank * size, size)
