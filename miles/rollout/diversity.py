"""Intra-group diversity (`rollout/diversity`): how different the samples of one prompt are from each other.

Per prompt group, the mean over its pairs of the root-mean-square difference of the two outputs, each first
average-pooled to at most 64 x 64 pixels (per frame for a video) so that the number compares layouts, not pixel
noise, and costs little at any resolution; then the mean over the groups with two or more samples. Images are in
[0, 1], so the value lies in [0, 1]: 0 when a prompt's samples are identical (a collapsed policy). A reward that is
hacked often drives a group's outputs together, which this shows before the reward curve does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

POOLED = 64


def pooled(image: torch.Tensor) -> torch.Tensor:
    """An image `[3, H, W]` (or video `[3, F, H, W]`) average-pooled to at most 64 x 64, flattened, fp32."""
    x = image.float()
    frames = x.unsqueeze(1) if x.ndim == 3 else x  # [3, F, H, W]
    flat = frames.permute(1, 0, 2, 3)  # [F, 3, H, W]
    h, w = flat.shape[-2:]
    if h > POOLED or w > POOLED:
        flat = torch.nn.functional.adaptive_avg_pool2d(flat, (min(h, POOLED), min(w, POOLED)))
    return flat.reshape(-1)


def group_diversity(images: Sequence[torch.Tensor]) -> float | None:
    """The mean pairwise RMS difference of one group's outputs (None for fewer than two)."""
    if len(images) < 2:
        return None
    x = torch.stack([pooled(img) for img in images])  # [n, D]
    # each pair once (`pdist`): 14x faster than the full `cdist` matrix at 16 x 64 x 64 x 3 (0.19 -> 0.014 s a
    # rollout of the tiny job), the same value up to rounding (2e-6 relative)
    return float((torch.pdist(x) / x.shape[1] ** 0.5).mean())


def intra_group_diversity(groups: Sequence[Sequence[Any]]) -> float | None:
    """The mean `group_diversity` over the groups of samples (their `image`s) that have two or more."""
    values = []
    for group in groups:
        images = [s.image for s in group if s.image is not None]
        value = group_diversity(images)
        if value is not None:
            values.append(value)
    return sum(values) / len(values) if values else None
