"""Built-in digits data: split, prompt JSONL, SFT image+caption set, resolve_dataset, `miles data digits`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from miles.builtin.datasets import resolve_dataset
from miles.builtin.names import is_builtin_dataset
from miles.core.errors import ConfigError
from miles.data.digits import downsample_to_digits, load_digits_split, prompt_for, upsample_digits


@pytest.mark.parametrize("spec", ["digits:train", "digits:test", "digits:labels", "digits:sft", "digits:sft-test"])
def test_is_builtin(spec):
    assert is_builtin_dataset(spec)


@pytest.mark.parametrize("spec", ["digits", "digits:", "digits:val", "mnist:train", "/data/train.jsonl", "c:\\x"])
def test_is_not_builtin(spec):
    assert not is_builtin_dataset(spec)


def test_split_is_deterministic_and_stratified(digits_split):
    again = load_digits_split()
    assert again is digits_split or np.array_equal(again.test_x, digits_split.test_x)
    assert digits_split.train_x.shape == (1437, 8, 8) and digits_split.test_x.shape == (360, 8, 8)
    assert digits_split.train_x.min() >= 0.0 and digits_split.train_x.max() <= 1.0
    assert np.bincount(digits_split.test_y).min() >= 35


def test_upsample_roundtrip(digits_split):
    x = digits_split.test_x[:10]
    up = upsample_digits(x)
    assert up.shape == (10, 64, 64)
    assert np.array_equal(downsample_to_digits(up), x)
    odd = np.repeat(np.repeat(x, 5, axis=1), 5, axis=2)  # 40x40: still exact block means
    assert np.allclose(downsample_to_digits(odd), x)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resolve_generates_once(miles_home, digits_split):
    from PIL import Image

    train = resolve_dataset("digits:train")
    assert train == miles_home / "data" / "digits" / "train.jsonl"
    rows = _read_jsonl(train)
    assert len(rows) == 1437
    assert rows[0] == {
        "input": prompt_for(int(digits_split.train_y[0])),
        "metadata": {"label": int(digits_split.train_y[0])},
    }
    assert rows[0]["input"].startswith("a handwritten digit ")
    test_rows = _read_jsonl(resolve_dataset("digits:test"))
    assert [r["metadata"]["label"] for r in test_rows] == digits_split.test_y.tolist()

    sft = resolve_dataset("digits:sft")
    sft_rows = _read_jsonl(sft)
    assert len(sft_rows) == 1437 and set(sft_rows[0]) == {"image", "input", "metadata"}
    img = Image.open(sft.parent / sft_rows[3]["image"])
    assert img.size == (64, 64) and img.mode == "RGB"
    gray = np.asarray(img, dtype=np.float32).mean(-1) / 255.0
    assert np.abs(downsample_to_digits(gray[None])[0] - digits_split.train_x[3]).max() < 1 / 255 + 1e-6
    assert len(_read_jsonl(resolve_dataset("digits:sft-test"))) == 360
    labels = _read_jsonl(resolve_dataset("digits:labels"))
    assert labels == [{"input": prompt_for(k), "metadata": {"label": k}} for k in range(10)]

    manifest = miles_home / "data" / "digits" / "digits.json"
    stamp = manifest.stat().st_mtime_ns
    assert resolve_dataset("digits:train") == train
    assert manifest.stat().st_mtime_ns == stamp  # reused, not regenerated
    assert not list((miles_home / "data").glob(".digits.tmp-*"))


def test_an_older_format_is_regenerated(miles_home):
    manifest = miles_home / "data" / "digits" / "digits.json"
    resolve_dataset("digits:train")
    labels = miles_home / "data" / "digits" / "labels.jsonl"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "format_version": 1}))
    labels.unlink()  # a copy written before digits:labels existed
    assert resolve_dataset("digits:labels") == labels and labels.is_file()
    assert json.loads(manifest.read_text())["format_version"] == data["format_version"]


def test_resolve_passthrough_and_errors(tmp_path):
    assert resolve_dataset(tmp_path / "mine.jsonl") == tmp_path / "mine.jsonl"
    with pytest.raises(ConfigError, match="unknown built-in data set 'digits:val'"):
        resolve_dataset("digits:val")


def test_data_cli(tmp_path, miles_home):
    from typer.testing import CliRunner

    from miles_cli.data_cmd import app

    runner = CliRunner()
    res = runner.invoke(app, ["digits", "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "d" / "train.jsonl").is_file() and (tmp_path / "d" / "sft" / "train.jsonl").is_file()
    assert "digits:train" in res.output
    res = runner.invoke(app, ["digits"])
    assert res.exit_code == 0 and str(miles_home / "data" / "digits" / "test.jsonl") in res.output
    (tmp_path / "file").write_text("x")
    res = runner.invoke(app, ["digits", "--out", str(tmp_path / "file")])
    assert isinstance(res.exception, ConfigError)
