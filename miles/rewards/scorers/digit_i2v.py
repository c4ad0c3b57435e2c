"""The digit image-to-video reward (`digit_i2v`): "the digit 7 moving left", from a first frame that must be kept.
The prompt row's metadata holds `label` (the digit) and `direction` (right, left, down, up); its condition image x is
the video's first frame. With y the output video (F frames) and y_0 its first frame:

    digit_i2v = video * keep
    video     = mean_f p_label(crop(y_f)) * travel
    travel    = clip(a / L, 0, 1) * exp(-(p / L)^2 / (2 * 0.25^2))
    keep      = sum_k sqrt(p_k(crop(y_0)) * p_k(crop(x))) * exp(-(|c(y_0) - c(x)| / s)^2 / (2 * 0.25^2))

All images are read as gray in [0, 1] on the 8-bit grid (as the `digit` reward reads them), positions in fractions of
the frame (any resolution):
  * crop(.) is the square of half the frame around a frame's ink centroid, pooled to the classifier's 8x8, and
    p(.) the checkpoint's digit classifier (`--hf-checkpoint`, as `digit` loads it): the digit reward's reading of a
    video frame (`miles.models.digit_classifier.videos_to_digits`). `mean_f p_label` is that reward;
  * a and p are the ink centroid's net displacement from the first to the last frame along the prompted direction
    and across it, L = 1/2 the travel of the data's videos (the digit, half the frame wide, crosses from one edge to
    the other): `travel` is 1 for a full crossing the prompted way, falls linearly with a shorter one, is 0 for no
    motion or any motion the wrong way, and a drift across the direction costs as a Gaussian (sigma a quarter of L,
    8 px on the 64-px frame: a drift of 8 px keeps exp(-1/2) = 0.61, one of 4 px 0.88);
  * `keep` is how well the output's first frame keeps the condition frame: the Bhattacharyya coefficient of the two
    crops' class distributions (1 for the same reading, 0 for disjoint ones: another digit in the first frame) times
    a Gaussian of the distance between their ink centroids in units of the digit's side s (half the frame), sigma a
    quarter of it (8 px on the 64-px frame: 8 px away keeps 0.61; the digit a whole side away, exp(-8)).

Copying the first frame into every frame gets travel 0; the video moving the wrong way gets travel 0 (and, when it
starts elsewhere, keep ~0); another digit gets p_label ~ 0 and a keep of the Bhattacharyya coefficient of two
digits. The data's own videos score `mean_f p_label` (about 0.95 on the tiny video classifier). Numpy,
deterministic; an image sample (one frame) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from miles.models.digit_classifier import as_classifier, digits_to_features, videos_to_digits
from miles.rewards.scorers._source import first_sources, sourced_scorer
from miles.rewards.scorers.digit import digit_label, load_digit_classifier, on_8_bits

if TYPE_CHECKING:
    from miles.rewards.dispatch import RewardSettings, Scorer

DIRECTIONS = {"right": (0.0, 1.0), "left": (0.0, -1.0), "down": (1.0, 0.0), "up": (-1.0, 0.0)}  # (row, col)
TRAVEL = 0.5  # of the frame: the data's digit (half the frame) crosses from one edge to the other
ACROSS_SIGMA = 0.25  # of TRAVEL: drift across the prompted direction
PLACE_SIGMA = 0.25  # of the digit's side (half the frame): the first frame's offset from the condition
DIGIT_SIDE = 0.5  # of the frame: the digit's side, the unit of the first frame's offset


def gray_video(video: Any) -> np.ndarray:
    """A video frames first ([F, 3, H, W] / [F, H, W, 3] / [F, H, W], float in [0, 1] or uint8) -> (F, H, W)
    float32 gray in [0, 1] on the 8-bit grid."""
    arr = np.asarray(on_8_bits(video), dtype=np.float32)
    if arr.ndim == 4 and arr.shape[1] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr[:, :3].mean(axis=1)
    elif arr.ndim == 4:
        arr = arr[..., :3].mean(axis=-1)
    if arr.ndim != 3:
        raise ValueError(f"expected a video, got shape {tuple(np.shape(video))}")
    return np.clip(arr, 0.0, 1.0)


def gray_image(image: Any) -> np.ndarray:
    """One image ([3, H, W] / [H, W, 3] / [H, W]) -> (H, W) float32 gray in [0, 1] on the 8-bit grid."""
    arr = np.asarray(on_8_bits(image), dtype=np.float32)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    if arr.ndim == 3:
        arr = arr[..., :3].mean(axis=-1)
    if arr.ndim != 2:
        raise ValueError(f"expected one image, got shape {tuple(np.shape(image))}")
    return np.clip(arr, 0.0, 1.0)


def centroid(g: np.ndarray) -> np.ndarray:
    """The ink centroid (row, col) of a gray frame in fractions of the frame (pixel centres; the centre when blank)."""
    from miles.data.digits_video import centroids

    return (centroids(g[None])[0] + 0.5) / np.asarray(g.shape, dtype=np.float64)


def travel_term(frames: np.ndarray, direction: str) -> tuple[float, float, float]:
    """(travel, along, across): the net centroid displacement first -> last frame along and across `direction`
    (fractions of the frame) and the factor they give."""
    if direction not in DIRECTIONS:
        raise ValueError(f"metadata.direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    move = centroid(frames[-1]) - centroid(frames[0])
    unit = np.asarray(DIRECTIONS[direction])
    along = float(move @ unit)
    across = float(abs(move[0] * unit[1] - move[1] * unit[0]))
    factor = float(np.clip(along / TRAVEL, 0.0, 1.0)) * float(
        np.exp(-((across / TRAVEL) ** 2) / (2.0 * ACROSS_SIGMA**2))
    )
    return factor, along, across


@dataclass(frozen=True)
class I2VTerms:
    """The factors of one sample's reward: `reward = p_label * travel * agreement * place`."""

    p_label: float  # mean over frames of the classifier's probability of the label
    travel: float
    agreement: float  # Bhattacharyya coefficient of the two first frames' class distributions
    place: float
    along: float  # the net displacement along the prompted direction, fractions of the frame
    offset: float  # |c(y_0) - c(x)| in units of the digit's side

    @property
    def video(self) -> float:
        return self.p_label * self.travel

    @property
    def keep(self) -> float:
        return self.agreement * self.place

    @property
    def reward(self) -> float:
        return self.video * self.keep


def i2v_terms(
    videos: Sequence[Any],
    sources: Sequence[Any],
    labels: Sequence[int],
    directions: Sequence[str],
    classifier: Any = None,
) -> list[I2VTerms]:
    """The reward's factors per (output video frames first, condition image, label, direction)."""
    if not len(videos) == len(sources) == len(labels) == len(directions):
        raise ValueError(f"{len(videos)} videos, {len(sources)} sources, {len(labels)} labels, {len(directions)} ...")
    if not len(videos):
        return []
    clf = as_classifier(classifier)
    out = []
    for video, source, label, direction in zip(videos, sources, labels, directions, strict=True):
        frames, first = gray_video(video), gray_image(source)
        if len(frames) < 2:
            raise ValueError(f"digit_i2v scores a video, got {len(frames)} frame (an image-to-video output)")
        x8 = np.concatenate([videos_to_digits([frames], "0,1"), videos_to_digits([first[None]], "0,1")])
        probs = clf.predict_proba(digits_to_features(x8))  # the frames' crops, then the condition's
        p_label = float(probs[:-1, int(label)].mean())
        travel, along, _ = travel_term(frames, str(direction))
        agreement = float(np.sqrt(np.clip(probs[0] * probs[-1], 0.0, None)).sum())
        offset = float(np.linalg.norm(centroid(frames[0]) - centroid(first))) / DIGIT_SIDE
        place = float(np.exp(-(offset**2) / (2.0 * PLACE_SIGMA**2)))
        out.append(I2VTerms(p_label, travel, min(agreement, 1.0), place, along, offset))
    return out


def digit_i2v_reward(
    videos: Sequence[Any],
    sources: Sequence[Any],
    labels: Sequence[int],
    directions: Sequence[str],
    classifier: Any = None,
) -> list[float]:
    """`video * keep` per (output video, condition image, label, direction)."""
    return [t.reward for t in i2v_terms(videos, sources, labels, directions, classifier)]


def digit_direction(meta: Mapping[str, Any]) -> str:
    """`metadata.direction`, one of right / left / down / up (ValueError naming what the row holds)."""
    direction = meta.get("direction")
    if direction not in DIRECTIONS:
        raise ValueError(
            f"digit_i2v needs metadata.direction, one of {', '.join(DIRECTIONS)}; the row has {direction!r}"
        )
    return str(direction)


def build(settings: RewardSettings) -> Scorer:
    """`--rm-type digit_i2v`."""
    path = None if settings.hf_checkpoint is None else Path(settings.hf_checkpoint)
    classifier = load_digit_classifier(path)

    def score(
        images: list[Any], prompts: list[str], metadata: list[Mapping[str, Any]], sources: list[list[Any]]
    ) -> list[float]:
        for image in images:
            if len(getattr(image, "shape", ())) != 4:
                raise ValueError(
                    f"digit_i2v scores an image-to-video output, got an image of shape {tuple(image.shape)}"
                )
        labels = [digit_label(m) for m in metadata]
        directions = [digit_direction(m) for m in metadata]
        return digit_i2v_reward(images, first_sources(sources), labels, directions, classifier)

    return sourced_scorer(score, "digit_i2v")
