"""--diffusion-flow-shift on sglang engines: the server's `--flow-shift`, and a view of the checkpoint whose
scheduler config has the shift (static), whose schedule is the in-process engine's at that shift.
(tests/sglang/test_sglang_engine_flags.py checks that a real server samples on it.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles.rollout.engines.sglang.engine import server_spec
from miles.rollout.engines.sglang.schedule import flow_shift_options, scheduler_config, served_checkpoint


def _command(**cli: object) -> list[str]:
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    return server_spec(args, "engine 0", "/nonexistent/python", "/ckpt", {}).command(30001, 30002)


def test_the_server_gets_the_flow_shift_only_when_set() -> None:
    assert flow_shift_options(None) == {}
    assert flow_shift_options(3) == {"flow_shift": 3.0}
    argv = _command(diffusion_flow_shift=3.0)
    assert argv[argv.index("--flow-shift") + 1] == "3.0"
    assert "--flow-shift" not in _command()


def _scheduler_schedule(checkpoint: Path, flow_shift: float | None, family_name: str) -> tuple:
    import diffusers

    from miles.models.families import get_family

    config = json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text())
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    return get_family(family_name).schedule(scheduler, 6, (1, 16, 8, 8), flow_shift)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "fixture"), [("sd3", "tiny_sd3_dir"), ("flux", "tiny_flux_dir")])
def test_the_served_scheduler_config_has_the_shift(
    family: str, fixture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """sd3's static shift and flux's dynamic one: the view's scheduler, as sglang builds it from its config,
    gives miles' schedule at --diffusion-flow-shift 3; `set_shift(3)` on the checkpoint's scheduler (sglang's
    `--flow-shift` alone) would not."""
    import diffusers
    import torch

    checkpoint: Path = request.getfixturevalue(fixture)
    view = served_checkpoint(checkpoint, 3.0, tmp_path)
    assert view == tmp_path / "checkpoint-flow-shift-3"
    config = json.loads((view / "scheduler" / "scheduler_config.json").read_text())
    assert (config["shift"], config["use_dynamic_shifting"]) == (3.0, False)
    original = scheduler_config(checkpoint)
    changed = ("shift", "use_dynamic_shifting")
    assert {k: v for k, v in config.items() if k not in changed} == {
        k: v for k, v in original.items() if k not in changed
    }
    entries = sorted(p.name for p in checkpoint.iterdir())
    assert sorted(p.name for p in view.iterdir()) == entries
    assert all((view / e).resolve() == (checkpoint / e).resolve() for e in entries if e != "scheduler")
    served_sigmas, served_t = _scheduler_schedule(view, None, family)
    miles_sigmas, miles_t = _scheduler_schedule(checkpoint, 3.0, family)
    assert torch.equal(served_sigmas, miles_sigmas) and torch.equal(served_t, miles_t)
    unshifted, _ = _scheduler_schedule(checkpoint, None, family)
    assert (served_sigmas - unshifted).abs().max() > 0.05  # the shift changed the schedule
    set_shift = diffusers.FlowMatchEulerDiscreteScheduler.from_config(original)
    set_shift.set_shift(3.0)
    if family == "sd3":  # spaced between the unshifted sigma_min and sigma_max: not miles' schedule
        set_shift.set_timesteps(6)
        assert (set_shift.sigmas.float() - miles_sigmas).abs().max() > 1e-3
    assert served_checkpoint(checkpoint, 3.0, tmp_path) == view  # rebuilt in place


@pytest.mark.slow
def test_a_checkpoint_is_served_as_it_is_without_a_shift_or_a_shift_key(
    tiny_sd3_dir: Path, tiny_wan2_2_dir: Path, tmp_path: Path
) -> None:
    assert served_checkpoint(tiny_sd3_dir, None, tmp_path) == tiny_sd3_dir.resolve()
    assert "shift" not in scheduler_config(tiny_wan2_2_dir)  # UniPC: sglang's Wan reads --flow-shift
    assert served_checkpoint(tiny_wan2_2_dir, 3.0, tmp_path) == tiny_wan2_2_dir.resolve()
    assert list(tmp_path.iterdir()) == []
