"""Checkpoint layout, round trip of every part (RNG included), the latest pointer, crash safety, errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from miles.core.errors import ConfigError
from miles.training import checkpoint as ckpt
from miles.training.checkpoint import (
    LATEST_FILE,
    available_steps,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from miles.training.ema import EmaShadow
from miles.training.optim import MilesLRScheduler


@pytest.fixture(scope="module", autouse=True)
def _import_torch_optim():
    """torch.optim's first optimizer imports torch._dynamo (about 1 s on CPU); pay it once, outside the tests."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), np.random.randn(2).tolist(), torch.rand(3).tolist())


def _training_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = MilesLRScheduler(opt, max_lr=0.1, decay_steps=10, decay_style="linear")
    ema = EmaShadow(model.named_parameters(), decay_init=0.3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    ema.update(model.named_parameters())
    return model, opt, sched, ema


def _parts(step_tag: int):
    model, opt, sched, ema = _training_state()
    return {
        "model.pt": model.state_dict(),
        "optimizer.pt": opt.state_dict(),
        "lr_scheduler.pt": sched.state_dict(),
        "ema.pt": ema.state_dict(),
        "tag.pt": torch.tensor([step_tag]),
    }


def test_round_trip_of_every_part(tmp_path):
    model, opt, sched, ema = _training_state()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian in numpy's state
    rng = rng_state()
    expected_draws = _draws()
    extra = {"rollout_id": 4, "next_rollout_id": 5, "data_source": {"epoch": 1, "offset": [3, 7]}}
    path = save_checkpoint(
        tmp_path / "ckpt",
        5,
        {
            "model.pt": model.state_dict(),
            "optimizer.pt": opt.state_dict(),
            "rng.pt": rng,
            "lr_scheduler.pt": sched.state_dict(),
            "ema.pt": ema.state_dict(),
        },
        {"extra.json": extra},
    )
    assert path == tmp_path / "ckpt" / "iter_0000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "ema.pt", "extra.json", "lr_scheduler.pt", "manifest.json", "model.pt", "optimizer.pt", "rng.pt",
    ]  # fmt: skip
    assert (tmp_path / "ckpt" / LATEST_FILE).read_text().strip() == "5"

    _draws()  # move every generator on
    step, loaded = load_checkpoint(tmp_path / "ckpt")
    assert step == 5
    assert loaded["extra.json"] == extra

    model2 = torch.nn.Linear(3, 2)
    model2.load_state_dict(loaded["model.pt"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    opt2.load_state_dict(loaded["optimizer.pt"])
    sched2 = MilesLRScheduler(opt2, max_lr=0.1, decay_steps=10, decay_style="linear")
    sched2.load_state_dict(loaded["lr_scheduler.pt"])
    assert sched2.num_steps == 1 and opt2.param_groups[0]["lr"] == pytest.approx(0.09)
    state1, state2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(state1[k]["exp_avg"], state2[k]["exp_avg"]) for k in state1)
    ema2 = EmaShadow(model2.named_parameters(), decay_init=0.3)
    ema2.load_state_dict(loaded["ema.pt"])
    assert ema2.num_updates == 1 and all(torch.equal(ema.shadow[n], ema2.shadow[n]) for n in ema.shadow)

    set_rng_state(loaded["rng.pt"])
    assert _draws() == expected_draws


def test_latest_pointer_and_ckpt_step(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _parts(step), {"extra.json": {"step": step}})
    assert available_steps(tmp_path) == [1, 2, 3]  # old iterations are kept
    step, loaded = load_checkpoint(tmp_path)
    assert step == 3 and loaded["extra.json"] == {"step": 3}
    step, loaded = load_checkpoint(tmp_path, ckpt_step=2, parts=["tag.pt", "extra.json"])
    assert step == 2 and set(loaded) == {"tag.pt", "extra.json"} and loaded["tag.pt"].item() == 2
    # The pointer names the most recent save, even a lower step (a re-run from --ckpt-step 1).
    save_checkpoint(tmp_path, 1, {"tag.pt": torch.tensor([11])})
    step, loaded = load_checkpoint(tmp_path)
    assert step == 1 and set(loaded) == {"tag.pt"} and loaded["tag.pt"].item() == 11
    assert available_steps(tmp_path) == [1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _parts(1), {"extra.json": {"step": 1}})
    real_save = torch.save
    calls = []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, _parts(2), {"extra.json": {"step": 2}})
    monkeypatch.undo()
    assert len(calls) == 3
    assert not (tmp_path / "iter_0000002").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", LATEST_FILE]  # temp dir cleaned up
    step, loaded = load_checkpoint(tmp_path)
    assert step == 1 and loaded["tag.pt"].item() == 1 and loaded["extra.json"] == {"step": 1}


def test_crash_before_the_pointer_update_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _parts(1))

    def failing_pointer(path, text):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "atomic_write_text", failing_pointer)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, _parts(2))
    monkeypatch.undo()
    step, loaded = load_checkpoint(tmp_path)
    assert step == 1 and loaded["tag.pt"].item() == 1
    assert load_checkpoint(tmp_path, ckpt_step=2)[1]["tag.pt"].item() == 2  # complete, just not yet "latest"


def test_failed_resave_puts_the_old_folder_back(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"tag.pt": torch.tensor([1])})
    real_replace = ckpt.os.replace

    def failing_replace(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        save_checkpoint(tmp_path, 1, {"tag.pt": torch.tensor([99])})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)[1]["tag.pt"].item() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", LATEST_FILE]


def test_leftover_temp_dir_of_a_killed_save_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 1, {"tag.pt": torch.tensor([1])})
    half = tmp_path / ".iter_0000002.tmp-dead"
    half.mkdir()
    (half / "model.pt").write_bytes(b"torn")
    assert available_steps(tmp_path) == [1]
    assert load_checkpoint(tmp_path)[0] == 1


def test_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--load .*no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match=f"--load .*no {LATEST_FILE}.*--ckpt-step.*available steps: none"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 3, {"tag.pt": torch.tensor([3])})
    with pytest.raises(ConfigError, match=r"--ckpt-step 7: no iter_0000007 .*available steps: 3\)"):
        load_checkpoint(tmp_path, ckpt_step=7)
    with pytest.raises(ConfigError, match=r"has no optimizer.pt.*--no-load-optim"):
        load_checkpoint(tmp_path, parts=["optimizer.pt"])
    (tmp_path / LATEST_FILE).write_text("9\n")
    with pytest.raises(ConfigError, match="names step 9 but iter_0000009 is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / LATEST_FILE).write_text("garbage")
    with pytest.raises(ConfigError, match="not a step number"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"end in \.json"):
        save_checkpoint(tmp_path, 4, {"meta.json": {}})
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(tmp_path, 4, {"../x.pt": 1})
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, {})


def test_rng_state_loads_with_weights_only(tmp_path):
    torch.save(rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    expected = _draws()  # the draws right after the capture
    set_rng_state(state)
    assert _draws() == expected
    set_rng_state({"python": None, "numpy": None, "torch": None, "cuda": None})  # nothing to restore: a no-op
