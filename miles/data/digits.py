"""scikit-learn's bundled 8x8 digits (no download) as miles data sets.

Pixel convention: white ink on black, intensity = value / 16 in [0, 1]. Images at the pipeline
resolution are the 8x8 digits upsampled by pixel repetition (nearest neighbour, each digit pixel
becomes a constant 8x8 block at 64x64), so block-averaging a 64x64 image gives the digit back
exactly; `downsample_to_digits` is that inverse for any size.

Files written by `write_digits_data(out_dir)`:
    train.jsonl, test.jsonl   prompt data, one line per example of the split:
                              {"input": "a handwritten digit 7", "metadata": {"label": 7}}
    labels.jsonl              the ten prompts, one per label, in label order: a rollout batch of
                              a multiple of 10 prompts then holds every digit equally often
    sft/train.jsonl           SFT pairs: {"image": "images/train_00000.png", "input": <caption>,
                              "metadata": {"label": 7}}; `image` is relative to the JSONL's folder
    sft/test.jsonl            the same for the test split
    sft/images/*.png          64x64 RGB PNGs
    digits.json               manifest: split sizes, seed, resolution, format version
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles.builtin.names import DATASET_FILES

IMAGE_SIZE = 64
DIGIT_SIZE = 8
SPLIT_SEED = 0
TEST_FRACTION = 0.2
FORMAT_VERSION = 2
PROMPT_TEMPLATE = "a handwritten digit {label}"
MANIFEST = "digits.json"
FILES = DATASET_FILES  # the part -> its file (one table for every built-in set: miles.builtin.names)
NUM_LABELS = 10


def prompt_for(label: int) -> str:
    return PROMPT_TEMPLATE.format(label=int(label))


@dataclass(frozen=True)
class DigitsSplit:
    """Digits in [0, 1] of shape (N, 8, 8) float32 and int64 labels."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


_SPLIT_CACHE: dict[int, DigitsSplit] = {}


def load_digits_split(seed: int = SPLIT_SEED) -> DigitsSplit:
    """The deterministic stratified 80/20 train/test split (1437 / 360 examples for seed 0)."""
    if seed not in _SPLIT_CACHE:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        data = load_digits()
        x = (data.images / 16.0).astype(np.float32)
        y = data.target.astype(np.int64)
        tr_x, te_x, tr_y, te_y = train_test_split(x, y, test_size=TEST_FRACTION, random_state=seed, stratify=y)
        _SPLIT_CACHE[seed] = DigitsSplit(tr_x, tr_y, te_x, te_y)
    return _SPLIT_CACHE[seed]


def upsample_digits(x8: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """(N, 8, 8) in [0, 1] -> (N, size, size) by pixel repetition (size must be a multiple of 8)."""
    if size % DIGIT_SIZE:
        raise ValueError(f"image size {size} is not a multiple of {DIGIT_SIZE}")
    k = size // DIGIT_SIZE
    return np.repeat(np.repeat(np.asarray(x8, dtype=np.float32), k, axis=-2), k, axis=-1)


def _pool_bounds(n: int, out: int) -> list[tuple[int, int]]:
    # adaptive average pooling windows (as torch.nn.functional.adaptive_avg_pool2d)
    return [((i * n) // out, -((-(i + 1) * n) // out)) for i in range(out)]


def downsample_to_digits(gray: np.ndarray) -> np.ndarray:
    """(N, H, W) gray in [0, 1] -> (N, 8, 8) by adaptive average pooling (exact block means at 64x64)."""
    gray = np.asarray(gray, dtype=np.float32)
    n, h, w = gray.shape
    if h % DIGIT_SIZE == 0 and w % DIGIT_SIZE == 0:
        return gray.reshape(n, DIGIT_SIZE, h // DIGIT_SIZE, DIGIT_SIZE, w // DIGIT_SIZE).mean(axis=(2, 4))
    out = np.empty((n, DIGIT_SIZE, DIGIT_SIZE), dtype=np.float32)
    rows, cols = _pool_bounds(h, DIGIT_SIZE), _pool_bounds(w, DIGIT_SIZE)
    for i, (r0, r1) in enumerate(rows):
        for j, (c0, c1) in enumerate(cols):
            out[:, i, j] = gray[:, r0:r1, c0:c1].mean(axis=(1, 2))
    return out


def digits_to_rgb_uint8(x8: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """(N, 8, 8) in [0, 1] -> (N, size, size, 3) uint8 RGB images."""
    gray = np.clip(np.rint(upsample_digits(x8, size) * 255.0), 0, 255).astype(np.uint8)
    return np.repeat(gray[..., None], 3, axis=-1)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_digits_data(out_dir: str | Path, seed: int = SPLIT_SEED) -> dict[str, Path]:
    """Write the digits prompt files and the SFT image+caption set into `out_dir`; return the paths."""
    from PIL import Image

    out = Path(out_dir)
    split = load_digits_split(seed)
    parts = {"train": (split.train_x, split.train_y), "test": (split.test_x, split.test_y)}
    for name, (x, y) in parts.items():
        write_jsonl(out / FILES[name], [{"input": prompt_for(k), "metadata": {"label": int(k)}} for k in y])
        images = digits_to_rgb_uint8(x)
        rows = []
        for i, (img, k) in enumerate(zip(images, y, strict=True)):
            rel = f"images/{name}_{i:05d}.png"
            (out / "sft" / "images").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(out / "sft" / rel)
            rows.append({"image": rel, "input": prompt_for(k), "metadata": {"label": int(k)}})
        write_jsonl(out / FILES["sft" if name == "train" else "sft-test"], rows)
    label_rows = [{"input": prompt_for(k), "metadata": {"label": k}} for k in range(NUM_LABELS)]
    write_jsonl(out / FILES["labels"], label_rows)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits",
        "split_seed": seed,
        "test_fraction": TEST_FRACTION,
        "num_train": len(split.train_y),
        "num_test": len(split.test_y),
        "image_size": IMAGE_SIZE,
        "upsampling": "nearest (pixel repetition); white ink on black; intensity = value / 16",
        "prompt_template": PROMPT_TEMPLATE,
        "files": FILES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / rel for name, rel in FILES.items()}
