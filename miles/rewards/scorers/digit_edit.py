"""The digit edit reward: "change the digit a into b, keeping its place and style". The prompt row's metadata holds
`label` = b (the digit to draw; `source_label` = a may be there too, the reward does not read it) and its condition
image is the source, a digit drawn somewhere on a canvas.

    digit_edit = p_b(crop(y)) * place * ink
    place      = exp(-|c(y) - c(x)|^2 / (2 sigma^2)),   sigma = 1/8 of the frame (8 px on a 64-px frame)
    ink        = min(m(y), m(x)) / max(m(y), m(x))        (1 when both are blank)

with x the source, y the edited image, both read as gray in [0, 1] (the mean of RGB, on the 8-bit grid as the digit
reward reads images):
  * c(.) the centre of the ink's box: per axis, the midpoint of the 2% and 98% quantiles of the ink profile (the
    frame's centre for a blank image), in fractions of the frame ((row + 0.5) / H, (col + 0.5) / W), so a source
    and an output of different sizes compare; robust to a few stray pixels, unlike a thresholded bounding box. sigma
    is a quarter of the 32-px digit on a 64-px canvas: two digits drawn in the same square have ink boxes up to one
    4-px block of the 8x8 grid apart, which costs them 12%;
  * crop(.) the square of half the frame's shorter side centred on c (clamped inside the frame), pooled to the 8x8
    digit the classifier reads; p_b its probability of b under the checkpoint's digit classifier (loaded as the
    `digit` reward loads it, from `--hf-checkpoint`);
  * m(.) the mean ink (gray) of the frame: it changes with the digit's size and stroke thickness.

`place * ink` (in [0, 1]) is the preservation: a b drawn elsewhere, twice as big or with a much thicker stroke loses
it; copying the source keeps it but gets p_b ~ 0, and a wrong digit in the right place gets p_b ~ 0. Every factor is
numpy and deterministic. A video sample is refused (the moving-digit I2V task is another reward); the source is the
row's first condition image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.data.digits import downsample_to_digits
from miles.models.digit_classifier import as_classifier, digits_to_features
from miles.rewards.scorers._source import is_video, sourced_scorer
from miles.rewards.scorers.digit import digit_label, load_digit_classifier, on_8_bits

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

PLACE_SIGMA = 1.0 / 8.0  # of the frame: 8 px on a 64-px frame
INK_QUANTILE = 0.02  # the ink box spans the 2%..98% quantiles of each axis's ink profile


def gray(image: Any) -> np.ndarray:
    """One image ([3, H, W] / [H, W, 3] / [H, W], float in [0, 1] or uint8) -> (H, W) float32 gray in [0, 1] on the
    8-bit grid."""
    arr = np.asarray(on_8_bits(image), dtype=np.float32)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    if arr.ndim == 3:
        arr = arr[..., :3].mean(axis=-1)
    if arr.ndim != 2:
        raise ValueError(f"expected one image, got shape {tuple(np.shape(image))}")
    return np.clip(arr, 0.0, 1.0)


def _profile_centre(profile: np.ndarray) -> float:
    total = float(profile.sum())
    if total <= 1e-6:
        return (len(profile) - 1) / 2.0
    cumulative = np.cumsum(profile) / total
    lo = int(np.searchsorted(cumulative, INK_QUANTILE))
    hi = int(np.searchsorted(cumulative, 1.0 - INK_QUANTILE))
    return (lo + hi) / 2.0


def ink_centre(g: np.ndarray) -> np.ndarray:
    """The centre (row, col) of the ink's 2%..98% box, in pixels."""
    return np.array([_profile_centre(g.sum(axis=1)), _profile_centre(g.sum(axis=0))])


def crop_digit(g: np.ndarray) -> np.ndarray:
    """The 8x8 digit the classifier reads: the square of half the frame's shorter side centred on the ink box,
    clamped inside the frame, block-pooled."""
    h, w = g.shape
    side = max(min(h, w) // 2, 1)
    row, col = ink_centre(g)
    top = int(np.clip(np.rint(row - (side - 1) / 2), 0, h - side))
    left = int(np.clip(np.rint(col - (side - 1) / 2), 0, w - side))
    return downsample_to_digits(g[None, top : top + side, left : left + side])[0]


@dataclass(frozen=True)
class EditTerms:
    """The factors of one sample's reward: `reward = p_label * place * ink`."""

    p_label: float
    place: float
    ink: float
    offset: float  # |c(y) - c(x)| in fractions of the frame

    @property
    def reward(self) -> float:
        return self.p_label * self.place * self.ink


def preservation_terms(edited: np.ndarray, source: np.ndarray) -> tuple[float, float, float]:
    """(place, ink, offset) of two gray images."""
    c_y = (ink_centre(edited) + 0.5) / np.array(edited.shape, dtype=np.float64)
    c_x = (ink_centre(source) + 0.5) / np.array(source.shape, dtype=np.float64)
    offset = float(np.linalg.norm(c_y - c_x))
    place = float(np.exp(-(offset**2) / (2.0 * PLACE_SIGMA**2)))
    m_y, m_x = float(edited.mean()), float(source.mean())
    high = max(m_y, m_x)
    ink = 1.0 if high <= 1e-8 else min(m_y, m_x) / high
    return place, ink, offset


def edit_terms(
    images: Sequence[Any], sources: Sequence[Any], labels: Sequence[int], classifier: Any = None
) -> list[EditTerms]:
    """The reward's factors per (edited image, source image, target digit)."""
    if not len(images) == len(sources) == len(labels):
        raise ValueError(f"{len(images)} images, {len(sources)} sources and {len(labels)} labels")
    if not len(images):
        return []
    edited = [gray(im) for im in images]
    x8 = np.stack([crop_digit(g) for g in edited])
    probs = as_classifier(classifier).predict_proba(digits_to_features(x8))
    out = []
    for k, (g, source, label) in enumerate(zip(edited, sources, labels, strict=True)):
        place, ink, offset = preservation_terms(g, gray(source))
        out.append(EditTerms(float(probs[k, int(label)]), place, ink, offset))
    return out


def digit_edit_reward(
    images: Sequence[Any], sources: Sequence[Any], labels: Sequence[int], classifier: Any = None
) -> list[float]:
    """`p_b(crop(y)) * place * ink` per (edited image, source image, target digit b)."""
    return [t.reward for t in edit_terms(images, sources, labels, classifier)]


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type digit_edit`."""
    path = None if settings.hf_checkpoint is None else Path(settings.hf_checkpoint)
    classifier = load_digit_classifier(path)

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        for image in images:
            if is_video(image):
                raise ValueError(
                    f"digit_edit scores an image edit, got a video of {image.shape[0]} frames (the moving-digit "
                    "I2V task needs another reward)"
                )
        labels = [digit_label(m) for m in metadata]
        firsts = []
        for per_sample in sources:
            if not per_sample:
                raise ValueError("no source image (the prompt row has no condition image)")
            firsts.append(per_sample[0])
        return digit_edit_reward(images, firsts, labels, classifier)

    return sourced_scorer(score, "digit_edit")
