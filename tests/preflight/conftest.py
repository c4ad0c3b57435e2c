"""Fixtures of the preflight tests: a job resolved from a recipe (torch- and Ray-free), a fixed machine, an empty
Hugging Face cache. No test here builds a model or starts Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from preflight_helpers import Job

from miles.config.resolve import resolve
from miles.preflight import cluster


@pytest.fixture(autouse=True)
def machine(monkeypatch: pytest.MonkeyPatch) -> cluster.Machine:
    """This machine as the cluster check sees it: no GPU and CPUs enough for every tiny recipe's plan (a test
    that wants another machine patches `local_machine` again)."""
    fixed = cluster.Machine(gpus=0, cpus=4, how="no /dev/nvidia* device, no nvidia-smi GPU")
    monkeypatch.setattr(cluster, "local_machine", lambda: fixed)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY", raising=False)
    return fixed


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache (HF_HUB_CACHE), offline."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def job(tmp_path: Path) -> Job:
    """`job(name, recipe=..., **flags)`: the resolved job, with --output-dir under tmp_path."""

    def make(name: str | None = "rl", recipe: str = "tiny-digits-grpo", replay: str | None = None, **cli: Any):
        cli.setdefault("output_dir", str(tmp_path / "out"))
        return resolve(name, cli={k: v for k, v in cli.items() if v is not None}, recipe=recipe, replay_path=replay)

    return make
