"""Moving digits: scikit-learn's 8x8 digits crossing a frame in a prompted direction (no download).

A video is `NUM_FRAMES` frames of `VIDEO_SIZE` x `VIDEO_SIZE` (white ink on black, gray in [0, 1]).
The digit is the 8x8 digit upsampled by pixel repetition to `DIGIT_PIXELS` (half the frame) and slides
at constant speed from one edge of the frame to the opposite one along the prompted direction, centred
on the other axis: "right" starts at the left edge (x = 0) and ends touching the right edge.

What a generated video is measured by (the digit reward and the eval metrics read it this way):
  * per frame, the digit is found by its ink centroid: the `DIGIT_PIXELS` square centred there
    (clamped inside the frame) is cropped and handed to the digit classifier (`crop_digits`);
  * the direction is that of the centroid's net displacement from the first to the last frame along
    its larger axis (`track_direction`); "none" when it moves less than `MIN_TRAVEL` of the frame.

Tensors are [F, H, W] gray or [3, F, H, W] RGB (the layout of a decoded video sample) in [0, 1].
"""

from __future__ import annotations

import numpy as np

from miles.data.digits import DIGIT_SIZE, upsample_digits

VIDEO_SIZE = 64
NUM_FRAMES = 9
DIGIT_PIXELS = VIDEO_SIZE // 2
DIRECTIONS = ("right", "left", "down", "up")
PROMPT_TEMPLATE = "the digit {label} moving {direction}"
MIN_TRAVEL = 0.1  # of the frame size: less net centroid motion than this reads as "none"


def prompt_for(label: int, direction: str) -> str:
    return PROMPT_TEMPLATE.format(label=int(label), direction=direction)


def positions(direction: str, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE, digit: int = DIGIT_PIXELS):
    """The digit square's top-left corner (row, col) per frame, integers."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    travel = size - digit
    steps = np.rint(np.linspace(0, travel, num_frames)).astype(int) if num_frames > 1 else np.zeros(1, dtype=int)
    centre = np.full(num_frames, travel // 2, dtype=int)
    if direction == "right":
        return np.stack([centre, steps], axis=1)
    if direction == "left":
        return np.stack([centre, travel - steps], axis=1)
    if direction == "down":
        return np.stack([steps, centre], axis=1)
    return np.stack([travel - steps, centre], axis=1)


def render_video(
    x8: np.ndarray, direction: str, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE
) -> np.ndarray:
    """One 8x8 digit in [0, 1] -> its moving video, (num_frames, size, size) float32 in [0, 1]."""
    digit = size // 2
    if digit % DIGIT_SIZE:
        raise ValueError(f"video size {size} must be a multiple of {2 * DIGIT_SIZE}")
    sprite = upsample_digits(np.asarray(x8, dtype=np.float32)[None], digit)[0]
    out = np.zeros((num_frames, size, size), dtype=np.float32)
    for f, (r, c) in enumerate(positions(direction, num_frames, size, digit)):
        out[f, r : r + digit, c : c + digit] = sprite
    return out


def _gray_frames(video: np.ndarray) -> np.ndarray:
    """[F, H, W] gray or [3, F, H, W] / [F, H, W, 3] RGB -> [F, H, W] gray float32."""
    video = np.asarray(video, dtype=np.float32)
    if video.ndim == 3:
        return video
    if video.ndim == 4 and video.shape[0] in (1, 3):
        return video.mean(axis=0)
    if video.ndim == 4 and video.shape[-1] in (1, 3):
        return video.mean(axis=-1)
    raise ValueError(f"cannot read a video of shape {video.shape}")


def centroids(video: np.ndarray) -> np.ndarray:
    """(F, 2) ink centroid (row, col) per frame in pixels; the frame centre for a blank frame."""
    gray = np.clip(_gray_frames(video), 0.0, 1.0)
    f, h, w = gray.shape
    mass = gray.sum(axis=(1, 2))
    rows = (gray.sum(axis=2) * np.arange(h)).sum(axis=1)
    cols = (gray.sum(axis=1) * np.arange(w)).sum(axis=1)
    safe = np.where(mass > 1e-6, mass, 1.0)
    out = np.stack([rows / safe, cols / safe], axis=1)
    out[mass <= 1e-6] = ((h - 1) / 2, (w - 1) / 2)
    return out


def crop_digits(video: np.ndarray, digit: int | None = None) -> np.ndarray:
    """(F, digit, digit) gray crops, each centred on its frame's ink centroid (clamped inside the frame)."""
    gray = np.clip(_gray_frames(video), 0.0, 1.0)
    _, h, w = gray.shape
    digit = digit or min(h, w) // 2
    out = np.empty((gray.shape[0], digit, digit), dtype=np.float32)
    for i, (r, c) in enumerate(centroids(gray)):
        top = int(np.clip(np.rint(r - (digit - 1) / 2), 0, h - digit))
        left = int(np.clip(np.rint(c - (digit - 1) / 2), 0, w - digit))
        out[i] = gray[i, top : top + digit, left : left + digit]
    return out


def track_direction(video: np.ndarray) -> str:
    """The direction the ink centroid travels from the first frame to the last ("none" if barely)."""
    track = centroids(video)
    gray = _gray_frames(video)
    d_row, d_col = track[-1] - track[0]
    if max(abs(d_row), abs(d_col)) < MIN_TRAVEL * max(gray.shape[1:]):
        return "none"
    if abs(d_col) >= abs(d_row):
        return "right" if d_col > 0 else "left"
    return "down" if d_row > 0 else "up"
