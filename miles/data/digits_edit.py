"""The embedded digits edit task (`digits-edit`): "make it a 5", keeping the digit's place and size.

A source is a digit of the split, upsampled to 48x48 and pasted at an offset in a black 64x64 canvas; its prompt
names the digit it should become (the source shows which one it is). The SFT target of a (source, b) pair is a
digit b of the same split pasted at the source's offset, so an edit that keeps the place is what the data shows.
The SFT set also holds one blank-canvas row per train digit: a black source, "make it a b", the full-canvas digit
b as the target (an edit with nothing to keep: drawing from the instruction alone). The reward that reads the task
is `digit_edit` (`miles.rewards.scorers.digit_edit`).

Why one digit in the instruction and the blank rows (measured, docs/performance.md "Editing the digits"): the
tiny text encoders have random weights, and the tiny model learns to copy the source long before it learns to
read which digit an instruction names; "change the 3 into a 5" (the source's digit named too) stayed at chance for
500 SFT steps, and with true CFG 4 reached 0.16 where "make it a 5" reached 0.58. The blank rows teach reading
the instruction, as a text-to-image model's training does before an edit model is made from it.

Parts (a folder under `$MILES_HOME/data/digits-edit`, written once by `write_digits_edit_data`):
    train.jsonl     one prompt row per train source: a random b != a, the source as condition media
    test.jsonl      the held-out prompts: one per test source, a random b != a
    sft/train.jsonl SFT rows (source media, instruction, target image), SFT_PAIRS_PER_SOURCE per train source,
                    then the blank-canvas rows
    sft/test.jsonl  the test sources' pairs (the prompt file's), for evaluation
Every edit row's metadata: `label` (the target digit b), `source_label` (a), `offset` ([row, col] of the paste);
a blank-canvas row's: `label` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from miles.builtin.names import DATASET_FILES
from miles.data.digits import SPLIT_SEED, load_digits_split, upsample_digits, write_jsonl

CANVAS = 64
DIGIT_PIXELS = 48
PROMPT_TEMPLATE = "make it a {target}"
SFT_PAIRS_PER_SOURCE = 4
BLANK_SOURCE = "sources/blank.png"
FORMAT_VERSION = 2  # 2: 48-px digits, "make it a b", the blank-canvas SFT rows
MANIFEST = "digits-edit.json"
FILES = {part: DATASET_FILES[part] for part in ("train", "test", "sft", "sft-test")}


def prompt_for(target: int) -> str:
    return PROMPT_TEMPLATE.format(target=target)


def paste(x8: np.ndarray, offset: tuple[int, int], pixels: int = DIGIT_PIXELS) -> np.ndarray:
    """An (8, 8) digit in [0, 1] as a `pixels` square at `offset` (row, col) of a black CANVAS image."""
    canvas = np.zeros((CANVAS, CANVAS), dtype=np.float32)
    r, c = offset
    canvas[r : r + pixels, c : c + pixels] = upsample_digits(x8[None], pixels)[0]
    return canvas


def to_png_rgb(gray: np.ndarray) -> np.ndarray:
    """(H, W) gray in [0, 1] -> (H, W, 3) uint8 (white ink on black)."""
    return np.repeat(np.clip(np.rint(gray * 255.0), 0, 255).astype(np.uint8)[..., None], 3, axis=-1)


def _targets(source: int, rng: np.random.Generator, count: int) -> list[int]:
    """`count` distinct target digits b != source."""
    return [int(b) for b in rng.choice([b for b in range(10) if b != source], size=count, replace=False)]


def write_digits_edit_data(
    out_dir: str | Path, seed: int = SPLIT_SEED, pixels: int = DIGIT_PIXELS, blank_rows: bool = True
) -> dict[str, Path]:
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
            offset = (int(rng.integers(0, CANVAS - pixels + 1)), int(rng.integers(0, CANVAS - pixels + 1)))
            source = f"sources/{name}_{i:05d}.png"
            Image.fromarray(to_png_rgb(paste(x8, offset, pixels))).save(out / source)
            targets = _targets(a, rng, pairs)
            for j, b in enumerate(targets):
                meta = {"label": b, "source_label": int(a), "offset": list(offset)}
                media = [{"role": "condition", "image": f"../{source}"}]
                if j == 0:  # the prompt files: one edit per source (media paths relative to each file)
                    row_media = [{"role": "condition", "image": source}]
                    prompts.append({"input": prompt_for(b), "media": row_media, "metadata": meta})
                target = f"targets/{name}_{i:05d}_{j}.png"
                donor = x[int(rng.choice(by_label[b]))]
                Image.fromarray(to_png_rgb(paste(donor, offset, pixels))).save(out / "sft" / target)
                sft.append({"image": target, "input": prompt_for(b), "media": media, "metadata": meta})
        if name == "train" and blank_rows:  # the blank-canvas rows: draw b from the instruction alone
            Image.fromarray(to_png_rgb(np.zeros((CANVAS, CANVAS), dtype=np.float32))).save(out / BLANK_SOURCE)
            for i, (x8, b) in enumerate(zip(x, y.tolist(), strict=True)):
                target = f"targets/{name}_{i:05d}_blank.png"
                Image.fromarray(to_png_rgb(upsample_digits(x8[None], CANVAS)[0])).save(out / "sft" / target)
                media = [{"role": "condition", "image": f"../{BLANK_SOURCE}"}]
                sft.append({"image": target, "input": prompt_for(b), "media": media, "metadata": {"label": int(b)}})
        write_jsonl(out / FILES[name], prompts)
        write_jsonl(out / FILES["sft" if name == "train" else "sft-test"], sft)
    manifest = {
        "format_version": FORMAT_VERSION,
        "source": "sklearn.datasets.load_digits, pasted (miles.data.digits_edit.paste)",
        "split_seed": seed,
        "canvas": CANVAS,
        "digit_pixels": pixels,
        "prompt_template": PROMPT_TEMPLATE,
        "sft_pairs_per_source": SFT_PAIRS_PER_SOURCE,
        "blank_canvas_rows": bool(blank_rows),
        "image_format": "PNG, RGB (white ink on black)",
        "files": FILES,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {name: out / rel for name, rel in FILES.items()}
