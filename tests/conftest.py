"""Shared fixtures. Nothing in the test session may download: the HF hubs are forced offline.

Session fixtures (built once, reused by every test directory):
  miles_session_home   $MILES_HOME for the whole session (a temp dir; autouse)
  tiny_sd3_dir         tiny-sd3 built once at $MILES_HOME/models/tiny-sd3, so
                       `ensure_checkpoint("tiny-sd3")` finds it too (treat it as read-only)
  tiny_sd3_pipeline    StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir) (read-only; copy to mutate)
  digit_classifier     the checkpoint's digit classifier
  digits_split         the deterministic digits train/test split
Function fixture:
  miles_home           a fresh, empty $MILES_HOME for one test (built-ins are rebuilt there on use)
"""

from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end or model-building tests (seconds to minutes)")


@pytest.fixture(scope="session", autouse=True)
def miles_session_home(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("miles_home")
    patch = pytest.MonkeyPatch()
    patch.setenv("MILES_HOME", str(home))
    yield home
    patch.undo()


@pytest.fixture
def miles_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "miles_home"
    home.mkdir()
    monkeypatch.setenv("MILES_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_sd3_dir(miles_session_home: Path) -> Path:
    from miles.models.checkpoints import ensure_checkpoint

    path = ensure_checkpoint("tiny-sd3", progress=False)
    assert path == miles_session_home / "models" / "tiny-sd3"
    return path


@pytest.fixture(scope="session")
def tiny_sd3_pipeline(tiny_sd3_dir: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def digit_classifier(tiny_sd3_dir: Path):
    from miles.rollout.rm_hub.digit import load_digit_classifier

    return load_digit_classifier(tiny_sd3_dir)


@pytest.fixture(scope="session")
def digits_split():
    from miles.data.digits import load_digits_split

    return load_digits_split()
