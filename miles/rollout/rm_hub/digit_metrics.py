"""Eval metrics for the digits task: accuracy and a Fréchet distance on digit-classifier features.

`fd` works like FID with the digit classifier in place of Inception: features are the classifier's
log-probabilities (10 values, floored at 1e-6), and the distance between two feature sets is
||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from miles.data.digits import load_digits_split
from miles.models.digit_classifier import _classifier, digits_to_features, images_to_digits

_LOG_FLOOR = 1e-6


def features_from_digits(x8: np.ndarray, classifier: Any = None) -> np.ndarray:
    probs = _classifier(classifier).predict_proba(digits_to_features(x8))
    return np.log(np.clip(probs, _LOG_FLOOR, 1.0))


def digit_features(images: Any, classifier: Any = None, value_range: str = "auto") -> np.ndarray:
    """(N, 10) classifier features of images (any format `digit_reward` accepts)."""
    return features_from_digits(images_to_digits(images, value_range), classifier)


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


def reference_features(classifier: Any = None, split: str = "test") -> np.ndarray:
    """Features of the real digits of a split ("train" or "test")."""
    data = load_digits_split()
    x8 = {"train": data.train_x, "test": data.test_x}[split]
    return features_from_digits(x8, classifier)


def digit_fd(images: Any, classifier: Any = None, split: str = "test", value_range: str = "auto") -> float:
    """`fd` of generated images against the real digits of `split`."""
    clf = _classifier(classifier)
    return frechet_distance(digit_features(images, clf, value_range), reference_features(clf, split))


def digit_accuracy(
    images: Any, labels: Sequence[int] | np.ndarray, classifier: Any = None, value_range: str = "auto"
) -> float:
    """Fraction of images the classifier reads as their label."""
    x8 = images_to_digits(images, value_range)
    pred = _classifier(classifier).predict(digits_to_features(x8))
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(labels) != len(pred):
        raise ValueError(f"{len(pred)} images but {len(labels)} labels")
    return float((pred == labels).mean()) if len(pred) else 0.0
