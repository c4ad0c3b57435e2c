"""Cached digits teachers carry their SFT step count (and their base's design), tiny builds their design; an
outdated copy is not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.builtin.checkpoints import is_complete
from miles.builtin.teachers import SFT_TEACHERS, STAMP_FILE, built_base_design, built_steps
from miles.models.tiny.metadata import METADATA_FILE, TINY_METADATA_FILE, built_design, current_design

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

    from miles.builtin.checkpoints import ensure_checkpoint

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


# ---- tiny builds carry their design ------------------------------------------------------------------------

WAN = "tiny-wan2_2"


def _tiny_build(path: Path, design: int | None) -> Path:
    path.mkdir(parents=True)
    meta = {"name": path.name} if design is None else {"name": path.name, "design": design}
    (path / TINY_METADATA_FILE).write_text(json.dumps(meta))
    (path / "model_index.json").write_text("{}")
    return path


def test_a_tiny_build_of_an_older_design_is_outdated(tmp_path: Path) -> None:
    assert current_design(WAN) >= 2  # wan's one-token-a-frame experts
    old = _tiny_build(tmp_path / "old" / WAN, None)  # built before the field: design 1
    assert built_design(old) == 1
    assert is_complete(old) and not is_complete(old, WAN)
    today = _tiny_build(tmp_path / "today" / WAN, current_design(WAN))
    assert is_complete(today, WAN)


def test_a_teacher_trained_from_an_older_base_design_is_stale(tmp_path: Path) -> None:
    name = "tiny-wan2_2-digits-sft-short"
    path = _whole(tmp_path / name, SFT_TEACHERS[name])  # a stamp without base_design: trained from design 1
    assert built_base_design(path) == 1 and not is_complete(path, name)
    stamp = {"name": name, "sft_steps": SFT_TEACHERS[name], "base_design": current_design(WAN)}
    (path / STAMP_FILE).write_text(json.dumps(stamp))
    assert is_complete(path, name)


def _stand_in_build(out_dir: Path, seed: int = 0, progress: bool = True) -> None:
    _tiny_build(Path(out_dir), current_design(WAN))
    (Path(out_dir) / "rebuilt").write_text(str(seed))


def test_ensure_checkpoint_rebuilds_an_outdated_cached_build(
    miles_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache logic, with a stand-in builder (the real one takes minutes): an older design in
    $MILES_HOME/models is replaced, today's design is reused."""
    from miles.builtin import checkpoints

    monkeypatch.setitem(checkpoints.TINY_BUILDERS, WAN, f"{__name__}:_stand_in_build")
    cached = _tiny_build(miles_home / "models" / WAN, None)
    (cached / "old-weights").write_text("x")
    assert checkpoints.ensure_checkpoint(WAN, progress=False) == cached
    assert (cached / "rebuilt").is_file() and not (cached / "old-weights").exists()
    assert built_design(cached) == current_design(WAN)
    (cached / "rebuilt").unlink()
    checkpoints.ensure_checkpoint(WAN, progress=False)
    assert not (cached / "rebuilt").exists()  # today's design: reused
