"""Eval metrics for the digits task: accuracy and a Fréchet distance on digit-classifier features.

`fd` works like FID with the digit classifier in place of Inception: features are the classifier's
log-probabilities (10 values, floored at 1e-6), and the distance between two feature sets is
||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)).

Videos (`[3, F, H, W]` items of a list, or a 5-D batch) are read frame by frame as the digit reward reads
them (`miles.rewards.scorers.digit.sample_digits`): accuracy is per frame (the mean over every frame of every
sample), `fd` is over the frames' features against those of the real digits' moving videos, and
`direction_accuracy` is the share of videos whose ink centroid travels the prompted way
(`miles.data.digits_video.track_direction`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from miles.data.digits import load_digits_split
from miles.models.digit_classifier import as_classifier, digits_to_features

_LOG_FLOOR = 1e-6


def features_from_digits(x8: np.ndarray, classifier: Any = None) -> np.ndarray:
    probs = as_classifier(classifier).predict_proba(digits_to_features(x8))
    return np.log(np.clip(probs, _LOG_FLOOR, 1.0))


def digit_features(images: Any, classifier: Any = None, value_range: str = "auto") -> np.ndarray:
    """(M, 10) classifier features of images (any format `digit_reward` accepts; a video gives one row per
    frame)."""
    from miles.rewards.scorers.digit import sample_digits

    return features_from_digits(sample_digits(images, value_range)[0], classifier)


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray, eps: float = 1e-6) -> float:
    """Fréchet distance between Gaussians fitted to two (N, D) feature sets (N >= 2 each)."""
    from scipy import linalg

    a = np.asarray(feats_a, dtype=np.float64)
    b = np.asarray(feats_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or len(a) < 2 or len(b) < 2:
        raise ValueError(f"need two (N>=2, D) feature sets with the same D, got {a.shape} and {b.shape}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(covmean).all():
        offset = np.eye(len(cov_a)) * eps
        covmean = linalg.sqrtm((cov_a + offset) @ (cov_b + offset))
    covmean = np.real(covmean)
    diff = mu_a - mu_b
    return float(max(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(covmean), 0.0))


def reference_features(classifier: Any = None, split: str = "test", video: bool = False) -> np.ndarray:
    """Features of the real digits of a split ("train" or "test"); `video`: of every frame of their moving
    videos (directions in turn), read as generated videos are (centroid crops)."""
    data = load_digits_split()
    x8, y = {"train": (data.train_x, data.train_y), "test": (data.test_x, data.test_y)}[split]
    if video:
        from miles.models.digit_classifier import moving_digit_crops

        x8, _ = moving_digit_crops(x8, y)
    return features_from_digits(x8, classifier)


def _has_video(images: Any) -> bool:
    if isinstance(images, (list, tuple)):
        return any(len(getattr(item, "shape", ())) == 4 for item in images)
    return len(getattr(images, "shape", ())) == 5


def digit_fd(images: Any, classifier: Any = None, split: str = "test", value_range: str = "auto") -> float:
    """`fd` of generated images against the real digits of `split` (videos: frames against the frames of the
    real moving digits)."""
    clf = as_classifier(classifier)
    reference = reference_features(clf, split, video=_has_video(images))
    return frechet_distance(digit_features(images, clf, value_range), reference)


def digit_accuracy(
    images: Any, labels: Sequence[int] | np.ndarray, classifier: Any = None, value_range: str = "auto"
) -> float:
    """Fraction of images the classifier reads as their label (videos: of all their frames)."""
    from miles.rewards.scorers.digit import sample_digits

    x8, owner = sample_digits(images, value_range)
    pred = as_classifier(classifier).predict(digits_to_features(x8))
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    n = int(owner.max()) + 1 if len(owner) else 0
    if len(labels) != n:
        raise ValueError(f"{n} images but {len(labels)} labels")
    return float((pred == labels[owner]).mean()) if len(pred) else 0.0


def _as_video_list(videos: Any) -> list[Any]:
    if isinstance(videos, (list, tuple)):
        return list(videos)
    return list(videos) if len(getattr(videos, "shape", ())) == 5 else [videos]


def video_directions(videos: Any, value_range: str = "auto") -> list[str]:
    """The direction each video's digit travels (`track_direction`: "right", "left", "down", "up", "none")."""
    from miles.data.digits_video import track_direction
    from miles.models.digit_classifier import to_numpy

    out = []
    for video in _as_video_list(videos):
        arr = to_numpy(video).astype(np.float32)
        signed = value_range == "-1,1" or (value_range == "auto" and arr.size and float(arr.min()) < -0.05)
        out.append(track_direction((arr + 1.0) / 2.0 if signed else arr))
    return out


def direction_accuracy(videos: Any, directions: Sequence[str], value_range: str = "auto") -> float:
    """Share of videos whose digit travels its prompted direction."""
    got = video_directions(videos, value_range)
    if len(got) != len(directions):
        raise ValueError(f"{len(got)} videos but {len(directions)} directions")
    return float(np.mean([g == str(d) for g, d in zip(got, directions, strict=True)])) if got else 0.0


def digit_eval_metrics(
    images: Sequence[Any],
    metadata: Sequence[Mapping[str, Any]],
    classifier: Any = None,
    value_range: str = "auto",
    sources: Sequence[Any] | None = None,
) -> dict[str, float]:
    """The digit metrics of eval samples whose metadata holds `label`: `accuracy` (per frame for videos),
    `fd` (when more than 10 digits/frames are read; videos against real moving digits' frames) and, for
    videos whose metadata holds `direction`, `direction_acc`.
    `images`: one `[3, H, W]` image or `[3, F, H, W]` video per sample. With `sources` (an edit: one source image
    per sample), the classifier reads what `digit_edit` reads: the crop at the source digit's size around the
    output's ink (the whole canvas would hold a digit pasted at an offset, which the classifier was not fitted to);
    video samples (image-to-video: the source is their first frame) are read per frame as without sources."""
    from miles.rewards.scorers.digit import sample_digits

    images = list(images)
    if len(images) != len(metadata):
        raise ValueError(f"{len(images)} samples but {len(metadata)} metadata")
    clf = as_classifier(classifier)
    labels = np.asarray([int(m["label"]) for m in metadata], dtype=np.int64)
    if sources is not None and not _has_video(images):
        from miles.rewards.scorers.digit_edit import edit_crops

        x8, owner = edit_crops(images, sources), np.arange(len(images))
    else:
        x8, owner = sample_digits(images, value_range)
    pred = clf.predict(digits_to_features(x8))
    out = {"accuracy": float((pred == labels[owner]).mean()) if len(pred) else 0.0}
    if len(x8) > 10:
        reference = reference_features(clf, video=_has_video(images))
        out["fd"] = frechet_distance(features_from_digits(x8, clf), reference)
    videos = [i for i, image in enumerate(images) if len(getattr(image, "shape", ())) == 4]
    directed = [i for i in videos if metadata[i].get("direction") is not None]
    if directed:
        out["direction_acc"] = direction_accuracy(
            [images[i] for i in directed], [metadata[i]["direction"] for i in directed], value_range
        )
    return out
