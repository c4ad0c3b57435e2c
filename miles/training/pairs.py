"""From rollout samples to train pairs, optimizer windows, dp shards and micro-batches.

A Flow-GRPO pair is one recorded SDE transition `(x_t, x_next, t, sigma, sigma_next, log_prob_old,
advantage, conditions)`; an NFT pair is `(x0, sigma, advantage, conditions)` at a trained sigma; an
SFT pair is `(x0, conditions)`; a DPO pair is a winner and a loser sample (`partner`) at one sigma.
Pairs are listed sample-major. The samples of one rollout are cut into
`num_steps_per_rollout` windows of `global_batch_size` samples (one optimizer step each); each window's
pairs are split over the dp ranks (`contiguous` or `stride`), then into micro-batches of
`micro_batch_size` pairs (flat), or 2D tiles of `micro_batch_size_sample` samples x
`micro_batch_size_tstep` timesteps visited in `--diffusion-train-iter-order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.core.sample import Sample


@dataclass
class Pair:
    sample: Sample  # DPO: the winner
    step: int  # the denoising step (Flow-GRPO), the trained sigma's position (NFT) or the draw (DPO)
    slot: int  # index into the sample's recorded log-probs (Flow-GRPO), the dataset row (SFT, offline DPO); else -1
    sigma: float | None = None  # NFT, DPO: the trained sigma
    partner: Sample | None = None  # DPO: the loser, noised with the winner's noise and sigma
    weight: float = 1.0  # DPO: the pair's weight in its window's mean (0: padding that evens the dp ranks' shares)


def expand_flow_grpo(samples: Sequence[Sample]) -> list[Pair]:
    """Every recorded SDE transition of every kept sample, sample-major."""
    pairs = []
    for sample in samples:
        if sample.remove_sample or sample.trajectory is None:
            continue
        for slot, step in enumerate(sample.trajectory.sde_step_indices):
            pairs.append(Pair(sample, step, slot))
    return pairs


def transition_problem(pair: Pair) -> str:
    """Why `pair` is not one of its sample's recorded SDE transitions ('' when it is)."""
    trajectory = pair.sample.trajectory
    if trajectory is None:
        return "its sample has no trajectory"
    recorded = list(trajectory.sde_step_indices)
    if not 0 <= pair.slot < len(recorded) or recorded[pair.slot] != pair.step:
        return f"step {pair.step} / slot {pair.slot} is not a recorded SDE transition (recorded: {recorded})"
    return ""


def windows(samples: Sequence[Sample], args: Any) -> list[list[Sample]]:
    """`num_steps_per_rollout` optimizer windows of `global_batch_size` samples, in order."""
    gbs = int(args.global_batch_size or len(samples))
    return [list(samples[i : i + gbs]) for i in range(0, len(samples), gbs)]


def dp_shard(items: Sequence[Any], rank: int, world: int, mode: str) -> list[Any]:
    if world == 1:
        return list(items)
    if mode == "stride":
        return list(items[rank::world])
    per, extra = divmod(len(items), world)
    start = rank * per + min(rank, extra)
    return list(items[start : start + per + (1 if rank < extra else 0)])


def micro_batches(pairs: Sequence[Pair], args: Any) -> list[list[Pair]]:
    """Flat cut of `micro_batch_size` pairs, or the 2D tile samples x timesteps."""
    s, t = args.micro_batch_size_sample, args.micro_batch_size_tstep
    if s is None or t is None:
        size = max(1, int(args.micro_batch_size))
        return [list(pairs[i : i + size]) for i in range(0, len(pairs), size)]
    by_sample: dict[int, list[Pair]] = {}
    for pair in pairs:
        by_sample.setdefault(id(pair.sample), []).append(pair)
    rows = list(by_sample.values())
    tiles = []
    for r in range(0, len(rows), s):
        block = rows[r : r + s]
        depth = max(len(row) for row in block)
        for c in range(0, depth, t):
            tiles.append([p for row in block for p in row[c : c + t]])
    if args.diffusion_train_iter_order == "timestep_major":
        tiles.sort(key=lambda tile: min(p.step for p in tile))
    return [tile for tile in tiles if tile]


def flow_grpo_batch(pairs: Sequence[Pair]) -> dict[str, Any]:
    """The tensors of a micro-batch of Flow-GRPO pairs, batch-first (B = len(pairs)).

    latents [B, C, h, w] x_t and next_latents x_{t+1} (fp32), timesteps, sigmas, next_sigmas, sigma_max,
    old_log_probs and advantages [B], the first pair's guidance_scale, sde_type and noise_level, and the
    pairs. The conditions are not stacked here: `stack_conditions` does that where they are needed.
    """
    samples = [p.sample for p in pairs]
    trajs = [s.trajectory for s in samples]
    steps = list(zip(trajs, pairs, strict=True))
    return {
        "latents": torch.stack([t.latents[p.step] for t, p in steps]).float(),
        "next_latents": torch.stack([t.latents[p.step + 1] for t, p in steps]).float(),
        "timesteps": torch.stack([t.timesteps[p.step] for t, p in steps]),
        "sigmas": torch.stack([t.sigmas[p.step] for t, p in steps]),
        "next_sigmas": torch.stack([t.sigmas[p.step + 1] for t, p in steps]),
        "sigma_max": torch.stack([t.sigmas[1] for t in trajs]),
        "old_log_probs": torch.stack([t.log_probs[p.slot] for t, p in steps]).float(),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "guidance_scale": samples[0].conditions.guidance_scale,
        "sde_type": trajs[0].sde_type,
        "noise_level": trajs[0].noise_level,
        "pairs": list(pairs),
    }


def stack_conditions(samples: Sequence[Sample], negative: bool, family: Any = None) -> dict[str, torch.Tensor]:
    """Batch the samples' stored condition rows (positive, or negative for CFG), with the family's
    `collate_conditions` (which pads variable-length text) when one is given, else by stacking."""
    rows = [s.conditions.negative if negative else s.conditions.positive for s in samples]  # type: ignore[union-attr]
    if any(r is None for r in rows):
        raise ValueError("a sample has no negative conditions, but CFG is on")
    if family is not None:
        return family.collate_conditions(rows)
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # type: ignore[index]
