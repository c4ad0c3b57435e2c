"""The built-in `digits-preference:*` set for offline DPO: each example's own image chosen, an image of another digit
rejected (seeded), written offline from the digits split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from miles.builtin.names import builtin_dataset_names, is_builtin_dataset
from miles.data.digit_preferences import rejected_indices


def test_rejected_images_show_another_digit_and_are_seeded() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2, 3])
    rejected = rejected_indices(labels, seed=0)
    assert all(labels[j] != labels[i] for i, j in enumerate(rejected))
    assert rejected.tolist() == rejected_indices(labels, seed=0).tolist()
    with pytest.raises(ValueError, match="at least two digits"):
        rejected_indices(np.array([4, 4]))
    assert {"digits-preference:train", "digits-preference:test"} <= set(builtin_dataset_names())
    assert is_builtin_dataset("digits-preference:train") and not is_builtin_dataset("digits-preference:sft")


@pytest.mark.slow
def test_the_built_in_set_is_made_on_first_use(miles_home: Path) -> None:
    from PIL import Image

    from miles.builtin.datasets import resolve_dataset

    train = resolve_dataset("digits-preference:train")
    assert train == miles_home / "data" / "digits-preference" / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 1437 and len(resolve_dataset("digits-preference:test").read_text().splitlines()) == 360
    row = rows[0]
    assert row["input"] == f"a handwritten digit {row['metadata']['label']}"
    assert row["metadata"]["rejected_label"] != row["metadata"]["label"]
    chosen, rejected = (Image.open(train.parent / row[key]) for key in ("chosen", "rejected"))
    assert chosen.size == rejected.size == (64, 64)
    manifest = json.loads((train.parent / "digits-preference.json").read_text())
    assert manifest["format_version"] == 1 and manifest["rows"] == {"train": 1437, "test": 360}


@pytest.mark.slow
def test_miles_data_digits_preference_writes_the_set(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from miles_cli.data_cmd import app

    result = CliRunner().invoke(app, ["digits-preference", "--out", str(tmp_path / "prefs")])
    assert result.exit_code == 0, result.output
    assert "digits-preference:train" in result.output and (tmp_path / "prefs" / "test.jsonl").is_file()
