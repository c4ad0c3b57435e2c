"""Cached digits teachers carry their SFT step count; a copy of another step count is not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.models.checkpoints import is_complete
from miles.models.digits_teachers import SFT_TEACHERS, STAMP_FILE, built_steps
from miles.models.tiny_sd3.metadata import METADATA_FILE

SHORT = "tiny-sd3-digits-sft-short"


def _whole(path: Path, steps: int | None) -> Path:
    path.mkdir()
    (path / METADATA_FILE).write_text("{}")
    (path / "model_index.json").write_text("{}")
    if steps is not None:
        (path / STAMP_FILE).write_text(json.dumps({"name": path.name, "sft_steps": steps}))
    return path


def test_a_teacher_of_todays_step_count_is_complete(tmp_path: Path) -> None:
    path = _whole(tmp_path / SHORT, SFT_TEACHERS[SHORT])
    assert built_steps(path, SHORT) == SFT_TEACHERS[SHORT]
    assert is_complete(path, SHORT)


@pytest.mark.parametrize("steps", [SFT_TEACHERS[SHORT] + 75, None])
def test_a_teacher_of_another_step_count_is_stale(tmp_path: Path, steps: int | None) -> None:
    # None: a copy made before the stamp existed, which had 450 steps
    path = _whole(tmp_path / SHORT, steps)
    assert built_steps(path, SHORT) != SFT_TEACHERS[SHORT]
    assert is_complete(path) and not is_complete(path, SHORT)


def test_an_unreadable_stamp_is_stale(tmp_path: Path) -> None:
    path = _whole(tmp_path / SHORT, None)
    (path / STAMP_FILE).write_text("not json")
    assert built_steps(path, SHORT) is None and not is_complete(path, SHORT)
