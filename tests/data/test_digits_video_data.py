"""The built-in `digits-video:*` data sets: prompt JSONL with balanced directions, the 40 label prompts, and the
SFT set of animated lossless WebP videos that decode back to the rendered moving digits."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from miles.builtin.datasets import resolve_dataset
from miles.builtin.names import builtin_dataset_names, is_builtin_dataset
from miles.data.digits_video import (
    DIRECTIONS,
    FORMAT_VERSION,
    NUM_FRAMES,
    VIDEO_SIZE,
    assign_directions,
    prompt_for,
    render_video,
    track_direction,
    video_to_rgb_uint8,
)

PARTS = ("train", "test", "labels", "sft", "sft-test")


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("part", PARTS)
def test_is_builtin(part):
    assert is_builtin_dataset(f"digits-video:{part}") and is_builtin_dataset(f"digits:{part}")
    assert f"digits-video:{part}" in builtin_dataset_names()


@pytest.mark.parametrize("spec", ["digits-video", "digits-video:", "digits-video:val", "digits_video:train"])
def test_is_not_builtin(spec):
    assert not is_builtin_dataset(spec)


def test_directions_are_deterministic_and_balanced_per_digit():
    labels = np.array([3, 3, 1, 3, 3, 1, 3])
    assert assign_directions(labels) == ["right", "left", "right", "down", "up", "left", "right"]


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_resolve_generates_the_video_set_once(miles_home, digits_split):
    from miles.io.video import read_video

    root = miles_home / "data" / "digits-video"
    train = resolve_dataset("digits-video:train")
    assert train == root / "train.jsonl"
    rows = _read_jsonl(train)
    assert len(rows) == 1437
    label0 = int(digits_split.train_y[0])
    assert rows[0] == {
        "input": f"the digit {label0} moving right",
        "metadata": {"label": label0, "direction": "right"},
    }
    assert [r["metadata"]["label"] for r in rows] == digits_split.train_y.tolist()
    for split_rows in (rows, _read_jsonl(resolve_dataset("digits-video:test"))):
        assert all(r["input"] == prompt_for(r["metadata"]["label"], r["metadata"]["direction"]) for r in split_rows)
        per_digit = Counter((r["metadata"]["label"], r["metadata"]["direction"]) for r in split_rows)
        for label in range(10):
            counts = [per_digit[(label, d)] for d in DIRECTIONS]
            assert max(counts) - min(counts) <= 1, (label, counts)  # every digit moves every way alike
    test_rows = _read_jsonl(root / "test.jsonl")
    assert len(test_rows) == 360 and [r["metadata"]["label"] for r in test_rows] == digits_split.test_y.tolist()

    labels = _read_jsonl(resolve_dataset("digits-video:labels"))
    assert len(labels) == 40
    assert labels[:5] == [
        {"input": "the digit 0 moving right", "metadata": {"label": 0, "direction": "right"}},
        {"input": "the digit 0 moving left", "metadata": {"label": 0, "direction": "left"}},
        {"input": "the digit 0 moving down", "metadata": {"label": 0, "direction": "down"}},
        {"input": "the digit 0 moving up", "metadata": {"label": 0, "direction": "up"}},
        {"input": "the digit 1 moving right", "metadata": {"label": 1, "direction": "right"}},
    ]
    assert {(r["metadata"]["label"], r["metadata"]["direction"]) for r in labels} == {
        (k, d) for k in range(10) for d in DIRECTIONS
    }

    sft = resolve_dataset("digits-video:sft")
    assert sft == root / "sft" / "train.jsonl"
    sft_rows = _read_jsonl(sft)
    assert len(sft_rows) == 1437 and set(sft_rows[0]) == {"video", "input", "metadata"}
    assert [r["metadata"] for r in sft_rows] == [r["metadata"] for r in rows]
    assert sft_rows[7]["video"] == "videos/train_00007.webp"
    for i in (0, 1, 2, 3, 500):  # the four directions and one more
        row = sft_rows[i]
        frames = read_video(sft.parent / row["video"])
        assert frames.shape == (NUM_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3)
        expected = video_to_rgb_uint8(render_video(digits_split.train_x[i], row["metadata"]["direction"]))
        assert np.array_equal(frames, expected)  # lossless
        assert track_direction(frames) == row["metadata"]["direction"]
    sft_test = _read_jsonl(resolve_dataset("digits-video:sft-test"))
    assert len(sft_test) == 360 and sft_test[0]["video"] == "videos/test_00000.webp"
    assert len(list((root / "sft" / "videos").glob("*.webp"))) == 1437 + 360

    manifest = root / "digits-video.json"
    data = json.loads(manifest.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["num_frames"] == NUM_FRAMES and data["fps"] == 8
    stamp = manifest.stat().st_mtime_ns
    assert resolve_dataset("digits-video:labels") == root / "labels.jsonl"
    assert manifest.stat().st_mtime_ns == stamp  # reused, not regenerated
    assert not list((miles_home / "data").glob(".digits-video.tmp-*"))
    assert not (miles_home / "data" / "digits").exists()  # the image set is its own, built only when asked

    # an older format is regenerated
    manifest.write_text(json.dumps({**data, "format_version": FORMAT_VERSION - 1}))
    (root / "labels.jsonl").unlink()
    assert resolve_dataset("digits-video:labels").is_file()
    assert json.loads(manifest.read_text())["format_version"] == FORMAT_VERSION


@pytest.mark.slow  # over a second (a build, a video set, a spawned process)
def test_miles_data_digits_video_writes_the_set(tmp_path) -> None:
    from typer.testing import CliRunner

    from miles_cli.data_cmd import app

    result = CliRunner().invoke(app, ["digits-video", "--out", str(tmp_path / "dv")])
    assert result.exit_code == 0, result.output
    assert "digits-video:labels" in result.output
    labels = (tmp_path / "dv" / "labels.jsonl").read_text().splitlines()
    assert len(labels) == 40
    bad = CliRunner().invoke(app, ["digits-video", "--out", str(tmp_path / "dv" / "labels.jsonl")])
    assert bad.exit_code != 0
