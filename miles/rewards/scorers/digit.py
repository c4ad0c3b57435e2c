"""The digit reward: the checkpoint's digit classifier's probability that a generated image shows
`metadata.label` (the classifier and its image handling: `miles.models.digit_classifier`).

A video sample (`[3, F, H, W]`; in a list, any 4-D item; as one array, a 5-D batch `[N, 3, F, H, W]`) is
read frame by frame with `videos_to_digits` (the digit around each frame's ink centroid) and its reward is
the mean over its frames of the probability of its label. Images and videos may be mixed in one list."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.models.digit_classifier import (
    CLASSIFIER_DIRNAME,
    as_classifier,
    digits_to_features,
    images_to_digits,
    load_digit_classifier,
    read_classifier_metadata,
    videos_to_digits,
)
from miles.utils.text import clip, clip_repr

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

__all__ = [
    "CLASSIFIER_DIRNAME",
    "build",
    "digit_label",
    "digit_probabilities",
    "digit_reward",
    "digits_to_features",
    "images_to_digits",
    "load_digit_classifier",
    "on_8_bits",
    "read_classifier_metadata",
    "sample_digits",
]


# ---- rewards -----------------------------------------------------------------------------------
def _ndim(x: Any) -> int:
    return len(getattr(x, "shape", ()))


def sample_digits(images: Any, value_range: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 digits the classifier reads of each sample, and which sample each came from:
    (M, 8, 8) float32 and (M,) int64 owners. An image gives one digit; a video one per frame.

    `images`: what `images_to_digits` reads (one image, a batch, a list), a 5-D video batch
    `[N, 3, F, H, W]`, or a list whose 4-D items are videos `[3, F, H, W]`."""
    if isinstance(images, (list, tuple)):
        items = list(images)
        if not any(_ndim(item) == 4 for item in items):
            x8 = images_to_digits(items, value_range)
            return x8, np.arange(len(x8), dtype=np.int64)
    elif _ndim(images) == 5:
        items = list(images)
    else:
        x8 = images_to_digits(images, value_range)
        return x8, np.arange(len(x8), dtype=np.int64)
    video_idx = [i for i, item in enumerate(items) if _ndim(item) == 4]
    image_idx = [i for i, item in enumerate(items) if _ndim(item) != 4]
    parts, owners = [], []
    if image_idx:
        parts.append(images_to_digits([items[i] for i in image_idx], value_range))
        owners.append(np.asarray(image_idx, dtype=np.int64))
    for i in video_idx:
        frames = videos_to_digits([items[i]], value_range)
        parts.append(frames)
        owners.append(np.full(len(frames), i, dtype=np.int64))
    x8, owner = np.concatenate(parts), np.concatenate(owners)
    order = np.argsort(owner, kind="stable")
    return x8[order], owner[order]


def _per_sample_mean(values: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    totals = np.bincount(owner, weights=values, minlength=n)
    counts = np.bincount(owner, minlength=n)
    return totals / np.maximum(counts, 1)


def digit_probabilities(images: Any, classifier: Any = None, value_range: str = "auto") -> np.ndarray:
    """(N, 10) class probabilities of the samples (a video's: the mean over its frames)."""
    x8, owner = sample_digits(images, value_range)
    probs = as_classifier(classifier).predict_proba(digits_to_features(x8))
    n = int(owner.max()) + 1 if len(owner) else 0
    if len(owner) == n:
        return probs
    return np.stack([_per_sample_mean(probs[:, k], owner, n) for k in range(probs.shape[1])], axis=1)


def digit_reward(
    images: Any, labels: Sequence[int] | np.ndarray, classifier: Any = None, value_range: str = "auto"
) -> list[float]:
    """The classifier's probability of each sample's label (one float per sample; a video: the mean over
    its frames)."""
    x8, owner = sample_digits(images, value_range)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    n = int(owner.max()) + 1 if len(owner) else 0
    if len(labels) != n:
        raise ValueError(f"{n} images but {len(labels)} labels")
    probs = as_classifier(classifier).predict_proba(digits_to_features(x8))
    per_digit = probs[np.arange(len(probs)), labels[owner]]
    return [float(p) for p in _per_sample_mean(per_digit, owner, n)]


# ---- the scorer of `--rm-type digit` ----------------------------------------------------------
def digit_label(meta: Mapping[str, Any]) -> int:
    """`metadata.label`, an integer 0-9: a float (3.7, 3.0), a bool or a string ("3") is refused, not rounded or
    parsed (ValueError quoting the value as the JSON line wrote it)."""
    if "label" not in meta:
        keys = clip(", ".join(map(repr, sorted(map(str, meta)))) or "no keys", 120)
        raise ValueError(f"the digit reward needs metadata.label (the digit to draw); metadata has {keys}")
    label = meta["label"]
    if isinstance(label, bool) or not isinstance(label, numbers.Integral):
        raise ValueError(f"metadata.label must be an integer 0-9, got {_as_json(label)}")
    if not 0 <= label <= 9:
        raise ValueError(f"metadata.label must be a digit 0-9, got {_as_json(label)}")
    return int(label)


def _as_json(value: Any) -> str:
    """`value` as a JSON line writes it (true, "3", NaN, Infinity), clipped; repr for what JSON cannot hold."""
    import json

    try:
        return clip(json.dumps(value), 80)
    except (TypeError, ValueError):
        pass
    try:
        return clip_repr(value)
    except ValueError:  # an int past Python's digit limit
        return "an integer too long to show"


def on_8_bits(image: Any) -> Any:
    """A float image (or video) on the 8-bit grid: round(clip(x, 0, 1) * 255) / 255 in float32, the pixels a saved
    PNG holds (uint8 images are read as uint8 / 255). The digit reward reads this, as the other built-ins read
    8-bit images, so a reward service that receives PNGs scores exactly what the job would in-process."""
    if hasattr(image, "detach"):
        image = image.detach().cpu()
        image = image.float().numpy() if image.is_floating_point() else image.numpy()
    arr = np.asarray(image)
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / np.float32(255.0)
    levels = np.clip(np.round(arr.astype(np.float32) * np.float32(255.0)), 0, 255).astype(np.uint8)
    return levels.astype(np.float32) / np.float32(255.0)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type digit`, the digit reward (`digit_reward`): an image's probability of its label; a video's, the mean
    over its frames (`[3, F, H, W]` samples are read per frame)."""
    path = None if settings.hf_checkpoint is None else Path(settings.hf_checkpoint)
    classifier = load_digit_classifier(path)

    def score(images: Sequence[Any], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[float]:
        labels = [digit_label(m) for m in metadata]
        return digit_reward([on_8_bits(im) for im in images], labels, classifier, value_range="0,1")

    return score
