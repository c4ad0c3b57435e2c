"""A preference set from the digits, for offline DPO (`train sft --loss-type dpo`), built offline from scikit-learn's
bundled digits (no download).

Each example of a split is one row: its prompt, `chosen` = its own image (the prompt's digit) and `rejected` = the
image of an example of another digit, drawn with a seeded generator (`rejected_label` in the metadata):

    {"input": "a handwritten digit 7", "chosen": "images/train_00012.png", "rejected": "images/train_00480.png",
     "metadata": {"label": 7, "rejected_label": 2}}

Files written by `write_digit_preference_data(out_dir)`:
    train.jsonl, test.jsonl   the rows of each split (`limit` cuts each split to its first rows)
    images/*.png              the 64x64 RGB images the rows name (as `miles.data.digits` draws them)
    digits-preference.json    manifest: row counts, seed, resolution, format version

A row is also a prompt line (`input` and `metadata.label`), so the files serve as digit-reward prompt data too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from miles.data.digits import IMAGE_SIZE, SPLIT_SEED, digits_to_rgb_uint8, load_digits_split, prompt_for, write_jsonl

FORMAT_VERSION = 1
MANIFEST = "digits-preference.json"
PAIR_SEED = 0
SPLITS = ("train", "test")


def rejected_indices(labels: np.ndarray, seed: int = PAIR_SEED) -> np.ndarray:
    """For each example, the index of an example with another label, drawn uniformly by `default_rng(seed)`."""
    labels = np.asarray(labels)
    if len(set(labels.tolist())) < 2:
        raise ValueError("a preference set needs examples of at least two digits")
    rng = np.random.default_rng(seed)
    out = np.empty(len(labels), dtype=np.int64)
    for i, label in enumerate(labels.tolist()):
        others = np.flatnonzero(labels != label)
        out[i] = others[rng.integers(len(others))]
    return out


def write_digit_preference_data(
    out_dir: str | Path, seed: int = SPLIT_SEED, limit: int | None = None, pair_seed: int = PAIR_SEED
) -> dict[str, Path]:
    """Write the preference rows of both digits splits (the first `limit` examples of each, when given) and the
    images they name into `out_dir`; return {split: its JSONL path}."""
    from PIL import Image

    out = Path(out_dir)
    split = load_digits_split(seed)
    parts = {"train": (split.train_x, split.train_y), "test": (split.test_x, split.test_y)}
    counts = {}
    for name, (x, y) in parts.items():
        if limit is not None:
            x, y = x[:limit], y[:limit]
        rejected = rejected_indices(y, pair_seed)
        images = digits_to_rgb_uint8(x)
        (out / "images").mkdir(parents=True, exist_ok=True)
        for i in sorted(set(range(len(y))) | set(rejected.tolist())):
            Image.fromarray(images[i]).save(out / "images" / f"{name}_{i:05d}.png")
        rows = [
            {
                "input": prompt_for(label),
                "chosen": f"images/{name}_{i:05d}.png",
                "rejected": f"images/{name}_{int(j):05d}.png",
                "metadata": {"label": int(label), "rejected_label": int(y[j])},
            }
            for i, (label, j) in enumerate(zip(y.tolist(), rejected, strict=True))
        ]
        write_jsonl(out / f"{name}.jsonl", rows)
        counts[name] = len(rows)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits (miles.data.digits' split)",
        "split_seed": seed,
        "pair_seed": pair_seed,
        "rows": counts,
        "image_size": IMAGE_SIZE,
        "chosen": "the example's own image",
        "rejected": "an image of another digit, uniform over the split",
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / f"{name}.jsonl" for name in SPLITS}
