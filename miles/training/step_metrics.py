"""The trainer's per-step metrics: the debug-mode model-output diffs against the engine's recorded outputs, and
the mean (or, for the `*_max_abs_diff` metrics, the maximum) over the trainer group's ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from miles.training.pairs import Pair


def model_output_diffs(v: torch.Tensor, batch: Sequence[Pair]) -> dict[str, float]:
    """`model_output_mean_abs_diff` / `_max_abs_diff`: the trainer's model output against the one the engine
    recorded at the same step (--diffusion-debug-mode); nothing when a sample has no debug tensors."""
    recorded = [p.sample.trajectory.debug_model_outputs for p in batch]  # type: ignore[union-attr]
    if not batch or any(r is None for r in recorded):
        return {}
    engine = torch.stack([r[p.step] for r, p in zip(recorded, batch, strict=True)]).float()  # type: ignore[index]
    diff = (v.detach().float().cpu() - engine).abs()
    return {"model_output_mean_abs_diff": float(diff.mean()), "model_output_max_abs_diff": float(diff.max())}


def is_max(key: str) -> bool:
    """Metrics aggregated by their maximum (over micro-batches, steps and ranks), not their mean."""
    return key.endswith("_max_abs_diff")


def all_reduce_mean(metrics: dict[str, float], world: int) -> dict[str, float]:
    if world == 1 or not dist.is_initialized():
        return metrics
    keys = sorted(k for k in metrics if not is_max(k))
    maxed = sorted(k for k in metrics if is_max(k))
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    out = {k: float(v) / world for k, v in zip(keys, values.tolist(), strict=True)}
    if maxed:
        peaks = torch.tensor([metrics[k] for k in maxed], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out.update(zip(maxed, peaks.tolist(), strict=True))
    return out
