"""Fixtures of the jobs' tests that condition on images (tests/conftest.py holds the session-wide ones).

i2v_rows    the digits-i2v set written for its first 8 train and 2 test digits (the image-to-video jobs: wan2_2_i2v,
            wan2_2_ti2v); read-only
edit_rows   four prompt rows and four SFT rows of the built-in digits-edit set, their media paths absolute (the edit
            jobs: flux_kontext, qwen_image_edit); read-only
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def i2v_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The digits-i2v set written for the first 8 train and 2 test digits (the set's own writer)."""
    import miles.data.digits_i2v as digits_i2v
    from miles.data.digits import DigitsSplit, load_digits_split

    split = load_digits_split()
    small = DigitsSplit(split.train_x[:8], split.train_y[:8], split.test_x[:2], split.test_y[:2])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(digits_i2v, "load_digits_split", lambda seed=0: small)
        return digits_i2v.write_digits_i2v_data(tmp_path_factory.mktemp("digits-i2v"))


@pytest.fixture(scope="module")
def edit_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four prompt rows and four SFT rows of the built-in edit set, with absolute media paths (a user's file)."""
    from miles.builtin.datasets import resolve_dataset

    folder = tmp_path_factory.mktemp("edit-rows")
    out = {}
    for part in ("train", "sft"):
        source = resolve_dataset(f"digits-edit:{part}")
        rows = [json.loads(line) for line in source.read_text().splitlines()[:4]]
        for row in rows:
            for medium in row["media"]:
                medium["image"] = str((source.parent / medium["image"]).resolve())
            if "image" in row:
                row["image"] = str((source.parent / row["image"]).resolve())
        out[part] = folder / f"{part}.jsonl"
        out[part].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
