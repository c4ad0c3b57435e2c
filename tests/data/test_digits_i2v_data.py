"""The built-in `digits-i2v:*` data sets: digits-video's rows with the video's first frame as the condition image
(a PNG relative to the JSONL), and SFT rows with the target video."""

from __future__ import annotations

import json

import numpy as np
import pytest

from miles.builtin.names import DATASET_CONDITION_IMAGES, builtin_dataset_names, is_builtin_dataset
from miles.data.digits import DigitsSplit
from miles.data.digits_video import assign_directions, prompt_for, render_video, video_to_rgb_uint8

PARTS = ("train", "test", "sft", "sft-test")


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("part", PARTS)
def test_is_builtin(part):
    assert is_builtin_dataset(f"digits-i2v:{part}") and f"digits-i2v:{part}" in builtin_dataset_names()
    assert not is_builtin_dataset("digits-i2v:labels")  # every row needs its own first frame
    assert DATASET_CONDITION_IMAGES["digits-i2v"] == 1


def test_the_writer_pairs_each_prompt_with_its_first_frame(tmp_path, monkeypatch, digits_split):
    """On the first 8 train and 4 test digits: digits-video's prompts and directions, the first frame as a PNG
    condition, the SFT video that starts with it."""
    from PIL import Image

    import miles.data.digits_i2v as digits_i2v
    from miles.io.video import read_video

    small = DigitsSplit(
        digits_split.train_x[:8], digits_split.train_y[:8], digits_split.test_x[:4], digits_split.test_y[:4]
    )
    monkeypatch.setattr(digits_i2v, "load_digits_split", lambda seed=0: small)
    paths = digits_i2v.write_digits_i2v_data(tmp_path)
    assert sorted(paths) == sorted(PARTS)
    rows, sft = _read_jsonl(paths["train"]), _read_jsonl(paths["sft"])
    directions = assign_directions(small.train_y)
    assert len(rows) == len(sft) == 8 and len(_read_jsonl(paths["test"])) == len(_read_jsonl(paths["sft-test"])) == 4
    for i, (row, pair) in enumerate(zip(rows, sft, strict=True)):
        label, direction = int(small.train_y[i]), directions[i]
        assert row == {
            "input": prompt_for(label, direction),
            "media": [{"role": "condition", "image": f"frames/train_{i:05d}.png"}],
            "metadata": {"label": label, "direction": direction},
        }
        assert pair["media"] == [{"role": "condition", "image": f"../frames/train_{i:05d}.png"}]
        assert {k: pair[k] for k in ("input", "metadata")} == {k: row[k] for k in ("input", "metadata")}
        frames = video_to_rgb_uint8(render_video(small.train_x[i], direction))
        first = np.asarray(Image.open(paths["train"].parent / row["media"][0]["image"]).convert("RGB"))
        video = read_video(paths["sft"].parent / pair["video"])
        assert np.array_equal(first, frames[0]) and np.array_equal(video, frames)  # lossless, starts at the condition
    manifest = json.loads((tmp_path / digits_i2v.MANIFEST).read_text())
    assert manifest["format_version"] == digits_i2v.FORMAT_VERSION and manifest["num_train"] == 8
