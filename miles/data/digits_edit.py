"""The embedded digits edit task (`digits-edit`): "change the 3 into a 5", keeping the digit's place, size and stroke.

A source is a digit of the split, upsampled to 32x32 and pasted at an offset in a black 64x64 canvas; its prompt
names the digit it shows and the one it should become. The SFT target of a (source, b) pair is a digit b of the
same split pasted at the source's offset, so an edit that keeps the place is what the data shows. The reward that
reads it is `digit_edit` (`miles.rewards.scorers.digit_edit`).

Parts (a folder under `$MILES_HOME/data/digits-edit`, written once by `write_digits_edit_data`):
    train.jsonl     one prompt row per train source: a random b != a, the source as condition media
    test.jsonl      the held-out prompts: one per test source, a random b != a
    sft/train.jsonl SFT rows (source media, instruction, target image), SFT_PAIRS_PER_SOURCE per train source
    sft/test.jsonl  the same for the test sources (the prompt file's pair), for evaluation
Every row's metadata: `label` (the target digit b), `source_label` (a), `offset` ([row, col] of the paste).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from miles.builtin.names import DATASET_FILES
from miles.data.digits import SPLIT_SEED, load_digits_split, upsample_digits, write_jsonl

CANVAS = 64
DIGIT_PIXELS = 32
PROMPT_TEMPLATE = "change the {source} into a {target}"
SFT_PAIRS_PER_SOURCE = 4
FORMAT_VERSION = 1
MANIFEST = "digits-edit.json"
FILES = {part: DATASET_FILES[part] for part in ("train", "test", "sft", "sft-test")}


def prompt_for(source: int, target: int) -> str:
    return PROMPT_TEMPLATE.format(source=source, target=target)


def paste(x8: np.ndarray, offset: tuple[int, int]) -> np.ndarray:
    """An (8, 8) digit in [0, 1] as a DIGIT_PIXELS square at `offset` (row, col) of a black CANVAS image."""
    canvas = np.zeros((CANVAS, CANVAS), dtype=np.float32)
    r, c = offset
    canvas[r : r + DIGIT_PIXELS, c : c + DIGIT_PIXELS] = upsample_digits(x8[None], DIGIT_PIXELS)[0]
    return canvas


def to_png_rgb(gray: np.ndarray) -> np.ndarray:
    """(H, W) gray in [0, 1] -> (H, W, 3) uint8 (white ink on black)."""
    return np.repeat(np.clip(np.rint(gray * 255.0), 0, 255).astype(np.uint8)[..., None], 3, axis=-1)


def _targets(source: int, rng: np.random.Generator, count: int) -> list[int]:
    """`count` distinct target digits b != source."""
    return [int(b) for b in rng.choice([b for b in range(10) if b != source], size=count, replace=False)]


def write_digits_edit_data(out_dir: str | Path, seed: int = SPLIT_SEED) -> dict[str, Path]:
    """Write the edit task's prompt files, source images and SFT targets into `out_dir`; return the part paths."""
    from PIL import Image

    out = Path(out_dir)
    split = load_digits_split(seed)
    rng = np.random.default_rng(1234 + seed)
    parts = {"train": (split.train_x, split.train_y), "test": (split.test_x, split.test_y)}
    for name, (x, y) in parts.items():
        by_label = {k: np.flatnonzero(y == k) for k in range(10)}
        (out / "sources").mkdir(parents=True, exist_ok=True)
        (out / "sft" / "targets").mkdir(parents=True, exist_ok=True)
        prompts, sft = [], []
        pairs = SFT_PAIRS_PER_SOURCE if name == "train" else 1
        for i, (x8, a) in enumerate(zip(x, y.tolist(), strict=True)):
            offset = (int(rng.integers(0, CANVAS - DIGIT_PIXELS + 1)), int(rng.integers(0, CANVAS - DIGIT_PIXELS + 1)))
            source = f"sources/{name}_{i:05d}.png"
            Image.fromarray(to_png_rgb(paste(x8, offset))).save(out / source)
            targets = _targets(a, rng, pairs)
            for j, b in enumerate(targets):
                meta = {"label": b, "source_label": int(a), "offset": list(offset)}
                media = [{"role": "condition", "image": f"../{source}"}]
                if j == 0:  # the prompt files: one edit per source (media paths relative to each file)
                    row_media = [{"role": "condition", "image": source}]
                    prompts.append({"input": prompt_for(a, b), "media": row_media, "metadata": meta})
                target = f"targets/{name}_{i:05d}_{j}.png"
                donor = x[int(rng.choice(by_label[b]))]
                Image.fromarray(to_png_rgb(paste(donor, offset))).save(out / "sft" / target)
                sft.append({"image": target, "input": prompt_for(a, b), "media": media, "metadata": meta})
        write_jsonl(out / FILES[name], prompts)
        write_jsonl(out / FILES["sft" if name == "train" else "sft-test"], sft)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits, pasted (miles.data.digits_edit.paste)",
        "split_seed": seed,
        "canvas": CANVAS,
        "digit_pixels": DIGIT_PIXELS,
        "prompt_template": PROMPT_TEMPLATE,
        "sft_pairs_per_source": SFT_PAIRS_PER_SOURCE,
        "image_format": "PNG, RGB (white ink on black)",
        "files": FILES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / rel for name, rel in FILES.items()}
