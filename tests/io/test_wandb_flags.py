"""--wandb-run-id, --wandb-team, --wandb-host and --wandb-key as wandb receives them (the offline wandb runs of
test_loggers.py cannot show a team, a host or a resumed id). Fast: a stand-in `wandb` module records `init`."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from miles.config.resolve import resolve
from miles.io.loggers import MetricsLogger

JOB = {
    "hf_checkpoint": "tiny-sd3",
    "prompt_data": "p.jsonl",
    "rm_type": "digit",
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "diffusion_num_sde_steps": 2,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
}


class FakeRun:
    def define_metric(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture
def inits(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: calls.append(kwargs) or FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    for name in ("WANDB_BASE_URL", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the logger sets
    return calls


def test_wandb_run_id_team_and_host_reach_wandb(inits: list, tmp_path: Path) -> None:
    cli = {
        "use_wandb": True,
        "wandb_run_id": "abc123",
        "wandb_team": "my-team",
        "wandb_host": "https://wandb.example.com",
        "wandb_key": "secret-key",
        "wandb_dir": str(tmp_path / "wb"),
    }
    MetricsLogger(resolve("rl", cli={**JOB, **cli}).args, tmp_path / "out", "rl", echo=lambda line: None)
    (kwargs,) = inits
    assert (kwargs["id"], kwargs["resume"], kwargs["entity"]) == ("abc123", "allow", "my-team")  # resumes that run
    assert os.environ["WANDB_BASE_URL"] == "https://wandb.example.com"
    assert os.environ["WANDB_API_KEY"] == "secret-key"
    assert "wandb_key" not in kwargs["config"] and kwargs["config"]["wandb_team"] == "my-team"

    inits.clear()
    MetricsLogger(resolve("rl", cli={**JOB, "use_wandb": True}).args, tmp_path / "out2", "rl", echo=lambda line: None)
    (kwargs,) = inits
    assert (kwargs["id"], kwargs["resume"], kwargs["entity"]) == (None, None, None)  # a new run, the default team
