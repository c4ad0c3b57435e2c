"""Cached digits teachers carry their SFT step count; a copy of another step count is not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.models.checkpoints import is_complete
from miles.models.digits_teachers import SFT_TEACHERS, STAMP_FILE, built_steps
from miles.models.tiny.metadata import METADATA_FILE

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


@pytest.mark.slow
def test_a_recipe_start_checkpoint_is_built_on_first_use_then_reused(
    tiny_sd3_dir: Path, miles_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tiny-digits-grpo` starts from tiny-sd3-digits-sft-short: built by SFT on first use (3 steps here
    instead of 525), exported whole, stamped, and found again without a rebuild."""
    from safetensors.torch import load_file

    from miles.models.checkpoints import ensure_checkpoint

    (miles_home / "models").mkdir()
    (miles_home / "models" / "tiny-sd3").symlink_to(tiny_sd3_dir)  # the session's build, not a second one
    monkeypatch.setitem(SFT_TEACHERS, SHORT, 3)
    path = ensure_checkpoint(SHORT, progress=False)
    assert path == miles_home / "models" / SHORT
    assert built_steps(path, SHORT) == 3 and is_complete(path, SHORT)
    (weights,) = (path / "transformer").glob("*.safetensors")
    (base,) = (tiny_sd3_dir / "transformer").glob("*.safetensors")
    trained, start = load_file(weights), load_file(base)
    assert trained.keys() == start.keys()
    assert any(not trained[k].equal(start[k]) for k in start)  # SFT moved the weights
    stamped = (path / STAMP_FILE).stat().st_mtime_ns
    assert ensure_checkpoint(SHORT, progress=False) == path
    assert (path / STAMP_FILE).stat().st_mtime_ns == stamped  # reused, not rebuilt
