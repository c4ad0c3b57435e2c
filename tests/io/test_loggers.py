"""MetricsLogger (stdout, metrics.jsonl, TensorBoard, wandb offline, image grids) and plot_curves.

wandb runs only in offline/disabled mode, silent, with no git/code/stats collection and no API key,
and with its cache/config/data dirs in a temp dir: it never reaches the network.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.io.loggers import IMAGE_KEY, MetricsLogger, run_name, summary_keys
from miles.io.metrics import read_metrics
from miles.io.plots import DPI, PANEL_SIZE, moving_average, plot_curves, read_series

_WANDB_ENV = {
    "WANDB_SILENT": "true",
    "WANDB_QUIET": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_META": "true",
    "WANDB_X_DISABLE_MACHINE_INFO": "true",
    "WANDB_ANONYMOUS": "never",
    "WANDB_BASE_URL": "http://127.0.0.1:9",  # a closed port, should anything ever try
}
_WANDB_UNSET = ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR")


@pytest.fixture(scope="module", autouse=True)
def _offline_wandb_env(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("wandb_home")
    patch = pytest.MonkeyPatch()
    for name, value in _WANDB_ENV.items():
        patch.setenv(name, value)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        patch.setenv(name, str(home / name.lower()))
    for name in _WANDB_UNSET:
        patch.delenv(name, raising=False)
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    patch.undo()


def make_args(**values: Any) -> Args:
    """Catalogue defaults (logging off) with `values` on top."""
    return schema_args(**values)


def metrics_for(rollout_id: int) -> dict[str, Any]:
    return {
        "rollout/reward/raw_mean": torch.tensor(0.1 * rollout_id),
        "rollout/reward/raw_std": 0.05,
        "train/loss": 1.0 / (rollout_id + 1),
        "train/kl_loss": 0.01,
        "train/grad_norm": 2.5,
        "train/log_prob_mean_abs_diff": 1e-6,
        "perf/step_time": 3.0,
        "perf/rollout_time": 2.0,
        "eval/pickscore_test": 0.7,
    }


def _png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
        return image.size


# --------------------------------------------------------------------- stdout and metrics.jsonl


def test_metrics_jsonl_rows(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(), tmp_path, "rl", echo=lambda line: None)
    for rollout_id in range(3):
        logger.log(rollout_id, metrics_for(rollout_id))
    logger.log(3, {"train/loss": float("nan"), "note": "text"})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["rollout_id"] for row in rows] == [0, 1, 2, 3]
    assert rows[2]["rollout/reward/raw_mean"] == pytest.approx(0.2)
    assert isinstance(rows[2]["rollout/reward/raw_mean"], float)  # the tensor became a number
    assert rows[1]["train/loss"] == 0.5
    assert set(rows[0]) == {"rollout_id", *metrics_for(0)}
    assert rows[3] == {"rollout_id": 3, "train/loss": "nan", "note": "text"}
    assert logger.metrics_path == tmp_path / "metrics.jsonl"
    assert not (tmp_path / "tensorboard").exists()
    assert logger.wandb_run is None


def test_stdout_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(make_args(), tmp_path, "rl")
    returned = logger.log(7, metrics_for(1))
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    line = out.strip()
    assert line == returned
    assert line.startswith("rollout 7")
    for key in (
        "rollout/reward/raw_mean=0.1",
        "train/loss=0.5",
        "train/kl_loss=0.01",
        "train/grad_norm=2.5",
        "train/log_prob_mean_abs_diff=1e-06",
        "perf/rollout_time=2",
        "perf/step_time=3",
        "eval/pickscore_test=0.7",
    ):
        assert key in line
    assert "raw_std" not in line
    order = [line.index(key) for key in ("rollout/reward", "train/loss", "train/kl_loss", "perf/", "eval/")]
    assert order == sorted(order)


def test_summary_keys_and_echo(tmp_path: Path) -> None:
    assert summary_keys({"eval/b": 1, "perf/z": 1, "train/loss": 1, "x": 1, "perf/a": 1}) == (
        "train/loss",
        "perf/a",
        "perf/z",
        "eval/b",
    )
    lines: list[str] = []
    MetricsLogger(make_args(), tmp_path, "sft", echo=lines.append).log(0, {"train/loss": 0.25})
    assert lines == ["rollout 0  train/loss=0.25"]


def test_run_name() -> None:
    assert re.fullmatch(r"rl-\d{8}-\d{6}-[0-9a-f]{6}", run_name("rl"))
    assert re.fullmatch(r"nft-\d{8}-\d{6}", run_name("nft", random_suffix=False))
    assert run_name("rl") != run_name("rl")


def test_import_is_light() -> None:
    code = (
        "import sys, miles.io.loggers, miles.io.plots\n"
        "heavy = [m for m in ('torch', 'wandb', 'tensorboard', 'matplotlib') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == ""


# --------------------------------------------------------------------- images and curves


def test_log_images_interval_and_grid(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(wandb_log_image_interval=2), tmp_path, "rl", echo=lambda line: None)
    images = [torch.rand(3, 16, 16) for _ in range(3)]
    captions = ["a cat | r=0.1", "a dog | r=0.2", "a fox | r=0.3"]
    written = [logger.log_images(rollout_id, images, captions) for rollout_id in range(4)]
    assert written[1] is None and written[3] is None
    assert written[0] == tmp_path / "images" / "rollout_0.png"
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["rollout_0.png", "rollout_2.png"]
    assert _png_size(tmp_path / "images" / "rollout_2.png")[0] == 3 * 128  # one row of three tiles
    with pytest.raises(ValueError, match="captions"):
        logger.log_images(0, images, captions[:2])
    assert logger.log_images(0, [], []) is None


def test_log_images_accepts_arrays_pil_and_video(tmp_path: Path) -> None:
    import numpy as np

    logger = MetricsLogger(make_args(), tmp_path, "rl", echo=lambda line: None)
    samples = [
        np.zeros((8, 8, 3), dtype=np.uint8),  # HWC uint8
        Image.new("RGB", (8, 8), "red"),
        torch.rand(4, 3, 8, 8),  # a video: its first frame goes in the grid
        np.ones((8, 8), dtype=np.float32),  # grey
    ]
    path = logger.log_images(5, samples, ["zeros", "pil", "video", "grey"])
    assert path is not None and _png_size(path) == (4 * 128, 128 + 28)


def test_close_writes_curves_once(tmp_path: Path) -> None:
    with MetricsLogger(make_args(), tmp_path, "rl", echo=lambda line: None) as logger:
        for rollout_id in range(4):
            logger.log(rollout_id, metrics_for(rollout_id))
    curves = tmp_path / "curves.png"
    assert _png_size(curves) == (int(3 * PANEL_SIZE[0] * DPI), int(PANEL_SIZE[1] * DPI))
    assert logger.close() is None  # already closed

    empty = tmp_path / "empty"
    assert MetricsLogger(make_args(), empty, "rl").close() is None
    assert not (empty / "curves.png").exists()


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_plot_curves_panels(tmp_path: Path) -> None:
    rows = [{"rollout_id": i, "train/loss": 1.0 / (i + 1), "rollout/reward/raw_mean": 0.01 * i} for i in range(25)]
    rows[3]["train/loss"] = "nan"  # non-finite values are written as text and skipped
    metrics = _write_rows(tmp_path / "metrics.jsonl", rows)
    out = plot_curves(metrics, tmp_path / "plots" / "curves.png")  # train/kl_loss is absent: 2 panels
    assert out == tmp_path / "plots" / "curves.png"
    assert out.stat().st_size > 1000
    assert _png_size(out) == (int(2 * PANEL_SIZE[0] * DPI), int(PANEL_SIZE[1] * DPI))

    one = plot_curves(metrics, tmp_path / "one.png", keys=("train/loss", "no/such/key"))
    assert one is not None and _png_size(one)[0] == int(PANEL_SIZE[0] * DPI)

    series = read_series(metrics, ("train/kl_loss", "train/loss", "rollout/reward/raw_mean"))
    assert list(series) == ["train/loss", "rollout/reward/raw_mean"]
    assert len(series["train/loss"][0]) == 24 and 3 not in series["train/loss"][0]


def test_plot_curves_nothing_to_plot(tmp_path: Path) -> None:
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    assert plot_curves(empty, tmp_path / "a.png") is None
    assert plot_curves(tmp_path / "missing.jsonl", tmp_path / "b.png") is None
    other = _write_rows(tmp_path / "other.jsonl", [{"rollout_id": 0, "perf/step_time": 1.0}])
    assert plot_curves(other, tmp_path / "c.png") is None
    assert not list(tmp_path.glob("*.png"))


def test_moving_average() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([], 3) == []


# --------------------------------------------------------------------- TensorBoard


def _scalars(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(event_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_scalars(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(use_tensorboard=True), tmp_path, "rl", echo=lambda line: None)
    for rollout_id in range(3):
        logger.log(rollout_id, {**metrics_for(rollout_id), "note": "not a number", "flag": True})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(metrics_for(0))
    assert [step for step, _ in scalars["train/loss"]] == [0, 1, 2]
    assert [value for _, value in scalars["rollout/reward/raw_mean"]] == pytest.approx([0.0, 0.1, 0.2])


def test_tensorboard_dir_flag(tmp_path: Path) -> None:
    board = tmp_path / "elsewhere"
    logger = MetricsLogger(
        make_args(use_tensorboard=True, tensorboard_dir=str(board)), tmp_path / "out", "rl", echo=lambda line: None
    )
    logger.log(4, {"train/loss": 0.5, "train/grad_norm": float("nan")})
    logger.close()
    assert not (tmp_path / "out" / "tensorboard").exists()
    scalars = _scalars(board)
    assert scalars["train/loss"] == [(4, 0.5)]
    assert math.isnan(scalars["train/grad_norm"][0][1])


# --------------------------------------------------------------------- wandb (offline)


def _run_dirs(wandb_dir: Path) -> list[Path]:
    return sorted((wandb_dir / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")  # --wandb-mode wins over the environment
    wandb_dir = tmp_path / "wb"
    args = make_args(
        use_wandb=True,
        wandb_mode="offline",
        wandb_dir=str(wandb_dir),
        wandb_project="miles-tests",
        wandb_group="g1",
        wandb_log_num_images=2,
        lr=3e-5,
    )
    logger = MetricsLogger(args, tmp_path / "out", "rl", echo=lambda line: None)
    run = logger.wandb_run
    assert run is not None
    assert re.fullmatch(r"rl-\d{8}-\d{6}-[0-9a-f]{6}", run.name)
    assert run.config["lr"] == 3e-5 and run.config["job"] == "rl"
    assert "wandb_key" not in run.config
    assert run.group == "g1" and run.project == "miles-tests"
    for rollout_id in range(3):
        logger.log(rollout_id, metrics_for(rollout_id))
    logger.log_images(2, [torch.rand(3, 8, 8) for _ in range(3)], ["a", "b", "c"])
    summary = dict(run.summary)
    assert summary["train/loss"] == pytest.approx(1 / 3)
    assert summary["rollout/reward/raw_mean"] == pytest.approx(0.2)
    assert summary["eval/pickscore_test"] == pytest.approx(0.7)
    assert IMAGE_KEY in summary
    logger.close()
    assert logger.wandb_run is None

    (run_dir,) = _run_dirs(wandb_dir)
    (record_file,) = run_dir.glob("*.wandb")
    records = record_file.read_bytes()
    for key in (b"train/loss", b"rollout/reward/raw_mean", b"perf/step_time", b"rollout_id"):
        assert key in records
    media = list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert len(media) == 2  # --wandb-log-num-images
    assert (tmp_path / "out" / "images" / "rollout_2.png").is_file()
    assert (tmp_path / "out" / "curves.png").is_file()


@pytest.mark.slow
def test_wandb_mode_flag_overrides_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_dir = tmp_path / "wb"
    args = make_args(use_wandb=True, wandb_mode="disabled", wandb_dir=str(wandb_dir))
    logger = MetricsLogger(args, tmp_path / "out", "rl", echo=lambda line: None)
    logger.log(0, {"train/loss": 1.0})
    logger.log_images(0, [torch.rand(3, 8, 8)], ["x"])
    logger.close()
    assert _run_dirs(wandb_dir) == []
    assert read_metrics(tmp_path / "out" / "metrics.jsonl") == [{"rollout_id": 0, "train/loss": 1.0}]

    # No random suffix: the name is just <job>-<timestamp>.
    args = make_args(use_wandb=True, wandb_mode="offline", wandb_dir=str(wandb_dir), disable_wandb_random_suffix=True)
    logger = MetricsLogger(args, tmp_path / "out2", "nft", echo=lambda line: None)
    assert re.fullmatch(r"nft-\d{8}-\d{6}", logger.wandb_run.name)
    logger.close()
    assert len(_run_dirs(wandb_dir)) == 1
