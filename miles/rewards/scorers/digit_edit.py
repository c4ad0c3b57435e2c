"""The digit edit reward: "change the digit a into b, keeping its place and size". The prompt row's metadata holds
`label` = b (the digit to draw; `source_label` = a may be there too, the reward does not read it) and its condition
image is the source, a digit drawn somewhere on a canvas.

    digit_edit = p_b(crop(y)) * place * size
    place      = exp(-|c(y) - c(x)|^2 / (2 sigma^2)),   sigma = s(x) / 4 (8 px for a 32-px digit)
    size       = min(s(y), s(x)) / max(s(y), s(x))

with x the source, y the edited image, both read as gray in [0, 1] (the mean of RGB, on the 8-bit grid as the digit
reward reads images):
  * c(.) the centre of the ink's box and s(.) its larger side: per axis, the box spans the 2% and 98% quantiles of
    the ink profile (robust to a few stray pixels, unlike a thresholded bounding box; a blank image's box is the
    whole frame). Offsets and sides are compared in fractions of the frame, so a source and an output of different
    resolutions compare. sigma is a quarter of the source digit: two digits drawn in the same square have ink
    boxes up to one block of the 8x8 grid apart, which costs them about 12 %;
  * crop(.) the square of side s(x) (the source digit's size) centred on c(y), clamped inside the frame, pooled to
    the 8x8 digit the classifier reads; p_b its probability of b under the checkpoint's digit classifier (loaded
    as the `digit` reward loads it, from `--hf-checkpoint`).

`place * size` (in [0, 1]) is the preservation: a b drawn elsewhere, or twice as big or small, loses it; copying the
source keeps it but gets p_b ~ 0, and a wrong digit in the right place gets p_b ~ 0. The stroke is not scored: the
task's targets are other writers' digits, whose ink differs from the source's by 12 % on average (the mean ink
ratio of the data's own (source, target) pairs is 0.88, which would cap a perfect edit there). Every factor is
numpy and deterministic. A video sample is refused (the moving-digit I2V task is `digit_i2v`'s); the source is the
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
from miles.rewards.scorers._source import first_sources, is_video, sourced_scorer
from miles.rewards.scorers.digit import digit_label, load_digit_classifier, on_8_bits

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

PLACE_SIGMA = 1.0 / 4.0  # of the source digit's side: 8 px for a 32-px digit
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


def _profile_span(profile: np.ndarray) -> tuple[int, int]:
    """The first and last index of the profile's 2%..98% quantile span (the whole axis when it is blank)."""
    total = float(profile.sum())
    if total <= 1e-6:
        return 0, len(profile) - 1
    cumulative = np.cumsum(profile) / total
    return int(np.searchsorted(cumulative, INK_QUANTILE)), int(np.searchsorted(cumulative, 1.0 - INK_QUANTILE))


def ink_box(g: np.ndarray) -> tuple[np.ndarray, float]:
    """The ink's 2%..98% box: its centre (row, col) and its larger side, in pixels."""
    (top, bottom), (left, right) = _profile_span(g.sum(axis=1)), _profile_span(g.sum(axis=0))
    return np.array([(top + bottom) / 2.0, (left + right) / 2.0]), float(max(bottom - top, right - left) + 1)


def ink_centre(g: np.ndarray) -> np.ndarray:
    """The centre (row, col) of the ink's 2%..98% box, in pixels."""
    return ink_box(g)[0]


def crop_digit(g: np.ndarray, side: float | None = None) -> np.ndarray:
    """The 8x8 digit the classifier reads: the square of `side` pixels (default: half the frame's shorter side)
    centred on the ink box, clamped inside the frame, block-pooled."""
    h, w = g.shape
    side = max(min(h, w) // 2, 1) if side is None else int(np.clip(np.rint(side), 1, min(h, w)))
    row, col = ink_centre(g)
    top = int(np.clip(np.rint(row - (side - 1) / 2), 0, h - side))
    left = int(np.clip(np.rint(col - (side - 1) / 2), 0, w - side))
    return downsample_to_digits(g[None, top : top + side, left : left + side])[0]


@dataclass(frozen=True)
class EditTerms:
    """The factors of one sample's reward: `reward = p_label * place * size`."""

    p_label: float
    place: float
    size: float
    offset: float  # |c(y) - c(x)| in units of the source digit's side

    @property
    def reward(self) -> float:
        return self.p_label * self.place * self.size


def preservation_terms(edited: np.ndarray, source: np.ndarray) -> tuple[float, float, float]:
    """(place, size, offset) of two gray images; offset in units of the source digit's side."""
    (centre_y, side_y), (centre_x, side_x) = ink_box(edited), ink_box(source)
    frame_y, frame_x = np.array(edited.shape, dtype=np.float64), np.array(source.shape, dtype=np.float64)
    digit = side_x / float(frame_x[0])  # the source digit's side in fractions of the frame's height
    offset = float(np.linalg.norm((centre_y + 0.5) / frame_y - (centre_x + 0.5) / frame_x)) / digit
    place = float(np.exp(-(offset**2) / (2.0 * PLACE_SIGMA**2)))
    s_y, s_x = side_y / float(frame_y[0]), digit
    size = min(s_y, s_x) / max(s_y, s_x)
    return place, size, offset


def _crops(edited: Sequence[np.ndarray], originals: Sequence[np.ndarray]) -> np.ndarray:
    """[N, 8, 8]: each edited gray image's crop at its source digit's side (scaled to the edited image's resolution)
    around its own ink, pooled to the classifier's 8x8 digit."""
    sides = [ink_box(x)[1] * y.shape[0] / x.shape[0] for x, y in zip(originals, edited, strict=True)]
    return np.stack([crop_digit(g, side) for g, side in zip(edited, sides, strict=True)])


def edit_crops(images: Sequence[Any], sources: Sequence[Any]) -> np.ndarray:
    """The 8x8 digits the reward's classifier reads, one per (edited image, source image): what `p_b` scores, and
    what the eval's `accuracy` and `fd` read for an edit (`digit_eval_metrics`)."""
    if len(images) != len(sources):
        raise ValueError(f"{len(images)} images but {len(sources)} sources")
    return _crops([gray(im) for im in images], [gray(source) for source in sources])


def edit_terms(
    images: Sequence[Any], sources: Sequence[Any], labels: Sequence[int], classifier: Any = None
) -> list[EditTerms]:
    """The reward's factors per (edited image, source image, target digit)."""
    if not len(images) == len(sources) == len(labels):
        raise ValueError(f"{len(images)} images, {len(sources)} sources and {len(labels)} labels")
    if not len(images):
        return []
    edited = [gray(im) for im in images]
    originals = [gray(source) for source in sources]
    x8 = _crops(edited, originals)
    probs = as_classifier(classifier).predict_proba(digits_to_features(x8))
    out = []
    for k, (g, x, label) in enumerate(zip(edited, originals, labels, strict=True)):
        place, size, offset = preservation_terms(g, x)
        out.append(EditTerms(float(probs[k, int(label)]), place, size, offset))
    return out


def digit_edit_reward(
    images: Sequence[Any], sources: Sequence[Any], labels: Sequence[int], classifier: Any = None
) -> list[float]:
    """`p_b(crop(y)) * place * size` per (edited image, source image, target digit b)."""
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
                    "I2V task is scored by digit_i2v)"
                )
        labels = [digit_label(m) for m in metadata]
        return digit_edit_reward(images, first_sources(sources), labels, classifier)

    return sourced_scorer(score, "digit_edit")
