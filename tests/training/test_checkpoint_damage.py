"""Damaged checkpoints: the manifest written at save, the fallback of `--load` to the newest complete checkpoint,
the refusal of a damaged `--ckpt-step`, and checkpoints saved before manifests (real files, no mocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.core.errors import ConfigError
from miles.training.checkpoint import (
    MANIFEST_FILE,
    find_loadable_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from miles.training.checkpoint_index import checkpoint_problems, file_checksum


def _save(root: Path, step: int) -> Path:
    parts = {"model.pt": {"w": torch.full((64, 64), float(step))}, "rng.pt": {"seed": step}}
    return save_checkpoint(root, step, parts, {"extra.json": {"rollout_id": step}})


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    _save(root, 3)
    _save(root, 4)
    return root


def _truncate(path: Path, keep: int) -> tuple[int, int]:
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return keep, len(data)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_save_writes_a_manifest_of_every_part(two_steps: Path) -> None:
    folder = two_steps / "iter_0000004"
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["checksum"] == "crc32" and sorted(manifest["files"]) == ["extra.json", "model.pt", "rng.pt"]
    for name, entry in manifest["files"].items():
        assert entry == {"size": (folder / name).stat().st_size, "crc32": file_checksum(folder / name)}
    assert checkpoint_problems(folder, "full") == []
    assert set(load_checkpoint(two_steps)[1]) == {"extra.json", "model.pt", "rng.pt"}  # the manifest is no part
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(two_steps, 5, {}, {MANIFEST_FILE: {}})


def test_a_truncated_file_of_the_latest_falls_back_with_a_warning(
    two_steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept, size = _truncate(two_steps / "iter_0000004" / "model.pt", 1234)
    warning = (
        f"--load {two_steps}: iter_0000004/model.pt is truncated ({kept:,} of {size:,} bytes); "
        "loading iter_0000003, the newest complete checkpoint"
    )
    choice = find_loadable_checkpoint(two_steps)
    assert (choice.step, choice.path, choice.warnings) == (3, two_steps / "iter_0000003", [warning])
    step, loaded = load_checkpoint(two_steps)
    assert step == 3 and loaded["extra.json"] == {"rollout_id": 3} and loaded["model.pt"]["w"][0, 0].item() == 3
    assert capsys.readouterr().err.strip() == f"miles: warning: {warning}"
    choice, _ = read_checkpoint(two_steps, parts=["extra.json"])
    assert choice.warnings == [warning]


def test_a_flipped_byte_is_caught_by_full_verification(two_steps: Path) -> None:
    _flip_a_byte(two_steps / "iter_0000004" / "model.pt")
    assert find_loadable_checkpoint(two_steps, verify="size").step == 4  # same size: a stat cannot see it
    choice = find_loadable_checkpoint(two_steps, verify="full")
    assert choice.step == 3
    assert choice.warnings == [
        f"--load {two_steps}: iter_0000004/model.pt is corrupted (its crc32 does not match the one saved with it); "
        "loading iter_0000003, the newest complete checkpoint"
    ]
    assert load_checkpoint(two_steps)[0] == 3


def test_no_complete_checkpoint_names_every_damaged_file(two_steps: Path) -> None:
    _truncate(two_steps / "iter_0000004" / "model.pt", 10)
    (two_steps / "iter_0000004" / "rng.pt").unlink()
    _flip_a_byte(two_steps / "iter_0000003" / "extra.json")
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(two_steps)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(
        f"--load {two_steps}: no complete checkpoint: iter_0000004/model.pt is truncated (10 of "
    )
    assert message.endswith(
        "; iter_0000004/rng.pt is missing; iter_0000003/extra.json is corrupted "
        "(its crc32 does not match the one saved with it)"
    )


def test_an_explicit_damaged_step_is_refused(two_steps: Path) -> None:
    _truncate(two_steps / "iter_0000003" / "model.pt", 100)
    with pytest.raises(ConfigError) as excinfo:
        find_loadable_checkpoint(two_steps, ckpt_step=3)
    assert str(excinfo.value).startswith("--ckpt-step 3: iter_0000003/model.pt is truncated (100 of ")
    assert str(excinfo.value).endswith("; pick another step (available steps: 3, 4)")
    with pytest.raises(ConfigError, match=r"^--ckpt-step 3: iter_0000003/model\.pt is truncated"):
        load_checkpoint(two_steps, ckpt_step=3)
    assert load_checkpoint(two_steps, ckpt_step=4)[0] == 4


def test_the_fallback_never_goes_past_the_latest_pointer(two_steps: Path) -> None:
    """After a re-run from --ckpt-step 3 the pointer names 3; step 4 belongs to the abandoned run."""
    _save(two_steps, 3)
    _truncate(two_steps / "iter_0000003" / "model.pt", 10)
    with pytest.raises(ConfigError, match=r"no complete checkpoint: iter_0000003/model\.pt is truncated"):
        find_loadable_checkpoint(two_steps)


def test_an_unreadable_manifest_counts_as_damage(two_steps: Path) -> None:
    (two_steps / "iter_0000004" / MANIFEST_FILE).write_text('{"files": {"model.pt": ')
    choice = find_loadable_checkpoint(two_steps)
    assert choice.step == 3 and "iter_0000004/manifest.json is unreadable (JSONDecodeError)" in choice.warnings[0]


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"model.pt": {"size": "abc"}}, 'the size of model.pt is "abc", not a byte count'),
        ({"model.pt": {"size": -1}}, "the size of model.pt is -1, not a byte count"),
        ({"model.pt": {"size": True}}, "the size of model.pt is true, not a byte count"),
        ({"model.pt": {"size": 10, "crc32": 7}}, "the crc32 of model.pt is 7, not a hex string"),
        ({"model.pt": 5}, "the entry of model.pt is a number, not a mapping"),
        ({"../x": {"size": 1}}, '"../x" is not a file name of the checkpoint folder'),
        ([1], "'files' is a list, not a mapping"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_damage_not_a_crash(two_steps: Path, files: object, why: str) -> None:
    manifest = {"version": 1, "checksum": "crc32", "files": files}
    (two_steps / "iter_0000004" / MANIFEST_FILE).write_text(json.dumps(manifest))
    choice = find_loadable_checkpoint(two_steps)
    assert (choice.step, choice.warnings) == (
        3,
        [
            f"--load {two_steps}: iter_0000004/manifest.json is not a valid manifest ({why}); loading iter_0000003, "
            "the newest complete checkpoint"
        ],
    )
    (two_steps / "iter_0000003" / MANIFEST_FILE).write_text("[]")
    with pytest.raises(ConfigError) as excinfo:
        find_loadable_checkpoint(two_steps)
    assert str(excinfo.value) == (
        f"--load {two_steps}: no complete checkpoint: iter_0000004/manifest.json is not a valid manifest ({why}); "
        "iter_0000003/manifest.json is not a valid manifest (a list, not an object)"
    )


def test_a_checkpoint_without_a_manifest_loads_as_before(two_steps: Path) -> None:
    for folder in (two_steps / "iter_0000003", two_steps / "iter_0000004"):
        (folder / MANIFEST_FILE).unlink()
    choice = find_loadable_checkpoint(two_steps, verify="full")
    assert (choice.step, choice.warnings) == (4, [])
    step, loaded = load_checkpoint(two_steps)
    assert step == 4 and loaded["model.pt"]["w"][0, 0].item() == 4
    # damage it cannot see before reading is still one line naming the file when torch.load fails
    _truncate(two_steps / "iter_0000004" / "model.pt", 200)
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(two_steps)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"--load {two_steps}: cannot read iter_0000004/model.pt (")
    assert message.endswith("); the file is damaged or not a miles checkpoint part (available steps: 3, 4)")


def test_the_index_module_imports_without_torch() -> None:
    code = "import sys, miles.training.checkpoint_index; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_dmd2_trainers_resume_from_one_step_when_one_latest_is_damaged(tmp_path: Path) -> None:
    """`<load>` (the student) and `<load>/critic` fall back together: the newest step complete in both."""
    from miles.training.checkpoint_index import common_step

    student, critic = tmp_path / "ckpt", tmp_path / "ckpt" / "critic"
    for step in (3, 4):
        _save(student, step)
        _save(critic, step)
    assert common_step([student, critic]) == 4
    _truncate(critic / "iter_0000004" / "model.pt", 10)
    assert common_step([student, critic]) == 3  # the student's intact step 4 is not taken alone
    assert common_step([student, critic], ckpt_step=4) == 4  # explicit: each load then refuses the damaged one
    _truncate(student / "iter_0000003" / "model.pt", 10)
    with pytest.raises(ConfigError, match="no step complete in every trainer's folder"):
        common_step([student, critic])
