"""The digit reward: the checkpoint's digit classifier's probability that a generated image shows
`metadata.label` (the classifier and its image handling: `miles.models.digit_classifier`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from miles.models.digit_classifier import (
    CLASSIFIER_DIRNAME,
    _classifier,
    digits_to_features,
    images_to_digits,
    load_digit_classifier,
    read_classifier_metadata,
)

__all__ = [
    "CLASSIFIER_DIRNAME",
    "digit_probabilities",
    "digit_reward",
    "digits_to_features",
    "images_to_digits",
    "load_digit_classifier",
    "read_classifier_metadata",
]


# ---- rewards -----------------------------------------------------------------------------------
def digit_probabilities(images: Any, classifier: Any = None, value_range: str = "auto") -> np.ndarray:
    """(N, 10) class probabilities of the images."""
    x8 = images_to_digits(images, value_range)
    return _classifier(classifier).predict_proba(digits_to_features(x8))


def digit_reward(
    images: Any, labels: Sequence[int] | np.ndarray, classifier: Any = None, value_range: str = "auto"
) -> list[float]:
    """The classifier's probability of each image's label (one float per image)."""
    probs = digit_probabilities(images, classifier, value_range)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(labels) != len(probs):
        raise ValueError(f"{len(probs)} images but {len(labels)} labels")
    return [float(p) for p in probs[np.arange(len(probs)), labels]]
