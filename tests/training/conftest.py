"""Fixtures of the trainer tests (the tiny-sd3 checkpoint itself comes from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import trainer_args


@pytest.fixture(scope="session")
def rollout(tiny_sd3_dir: Path):
    """`(manager, batch)`: an in-process rollout manager of the SMALL job and its rollout 0 (8 samples x 2
    SDE steps). A test that pushes weights into the manager's engine puts the original ones back."""
    from miles.rollout.manager import RolloutManager

    manager = RolloutManager(trainer_args(tiny_sd3_dir))
    return manager, manager.generate(0)
