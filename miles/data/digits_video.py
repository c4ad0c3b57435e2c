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

Files written by `write_digits_video_data(out_dir)` (the built-in `digits-video:*` data sets):
    train.jsonl, test.jsonl   prompt data, one line per example of the digits split (the same split as
                              `digits`): {"input": "the digit 7 moving left",
                              "metadata": {"label": 7, "direction": "left"}}; within each digit the k-th
                              example moves DIRECTIONS[k % 4], so every digit moves every way equally often
    labels.jsonl              the 40 prompts, digit-major (0 right, 0 left, 0 down, 0 up, 1 right, ...): a
                              rollout batch of a multiple of 40 prompts holds every (digit, direction) equally
    sft/train.jsonl           SFT pairs: {"video": "videos/train_00000.webp", "input": <caption>,
                              "metadata": {"label": 7, "direction": "left"}}; `video` is relative to the
                              JSONL's folder
    sft/test.jsonl            the same for the test split
    sft/videos/*.webp         animated lossless WebP, NUM_FRAMES frames of 64x64 RGB at VIDEO_FPS
    digits-video.json         manifest: split sizes, seed, frames, size, format version
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from miles.builtin.names import DATASET_FILES
from miles.data.digits import DIGIT_SIZE, SPLIT_SEED, load_digits_split, upsample_digits, write_jsonl

VIDEO_SIZE = 64
NUM_FRAMES = 9
DIGIT_PIXELS = VIDEO_SIZE // 2
DIRECTIONS = ("right", "left", "down", "up")
PROMPT_TEMPLATE = "the digit {label} moving {direction}"
MIN_TRAVEL = 0.1  # of the frame size: less net centroid motion than this reads as "none"
VIDEO_FPS = 8
FORMAT_VERSION = 1
MANIFEST = "digits-video.json"
FILES = DATASET_FILES  # the part -> its file (miles.builtin.names)


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


def render_video(x8: np.ndarray, direction: str, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE) -> np.ndarray:
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
    _, h, w = gray.shape
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


# ---- the built-in data set ---------------------------------------------------------------------
def assign_directions(labels: np.ndarray) -> list[str]:
    """The direction of each example: within each digit, its k-th example moves DIRECTIONS[k % 4]."""
    seen: dict[int, int] = {}
    out = []
    for label in np.asarray(labels).tolist():
        k = seen.get(int(label), 0)
        seen[int(label)] = k + 1
        out.append(DIRECTIONS[k % len(DIRECTIONS)])
    return out


def label_prompts() -> list[dict]:
    """The 40 prompt rows, digit-major: every digit in every direction."""
    return [
        {"input": prompt_for(label, d), "metadata": {"label": label, "direction": d}}
        for label in range(10)
        for d in DIRECTIONS
    ]


def video_to_rgb_uint8(gray: np.ndarray) -> np.ndarray:
    """(F, H, W) gray in [0, 1] -> (F, H, W, 3) uint8 RGB frames."""
    frames = np.clip(np.rint(np.asarray(gray, dtype=np.float32) * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(frames[..., None], 3, axis=-1)


def write_digits_video_data(out_dir: str | Path, seed: int = SPLIT_SEED) -> dict[str, Path]:
    """Write the moving-digits prompt files and the SFT video+caption set into `out_dir`; return the paths."""
    from miles.io.video import encode_video

    out = Path(out_dir)
    split = load_digits_split(seed)
    parts = {"train": (split.train_x, split.train_y), "test": (split.test_x, split.test_y)}
    (out / "sft" / "videos").mkdir(parents=True, exist_ok=True)
    for name, (x, y) in parts.items():
        directions = assign_directions(y)
        meta = [{"label": int(k), "direction": d} for k, d in zip(y, directions, strict=True)]
        write_jsonl(
            out / FILES[name], [{"input": prompt_for(m["label"], m["direction"]), "metadata": m} for m in meta]
        )
        rows = []
        for i, (x8, m) in enumerate(zip(x, meta, strict=True)):
            rel = f"videos/{name}_{i:05d}.webp"
            frames = video_to_rgb_uint8(render_video(x8, m["direction"]))
            (out / "sft" / rel).write_bytes(encode_video(frames, "webp", fps=VIDEO_FPS))  # the folder is atomic
            rows.append({"video": rel, "input": prompt_for(m["label"], m["direction"]), "metadata": m})
        write_jsonl(out / FILES["sft" if name == "train" else "sft-test"], rows)
    write_jsonl(out / FILES["labels"], label_prompts())
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits, moving (miles.data.digits_video.render_video)",
        "split_seed": seed,
        "num_train": len(split.train_y),
        "num_test": len(split.test_y),
        "video_size": VIDEO_SIZE,
        "num_frames": NUM_FRAMES,
        "fps": VIDEO_FPS,
        "directions": list(DIRECTIONS),
        "video_format": "animated lossless WebP, RGB (white ink on black)",
        "prompt_template": PROMPT_TEMPLATE,
        "files": FILES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / rel for name, rel in FILES.items()}
