"""MetricsLogger with video samples `[3, F, H, W]`: the PNG grid (first frames), the animated WebP grid and one
WebP per sample under `images/`, an animated GIF grid in TensorBoard, and GIF `wandb.Video`s (offline)."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config.args import Args
from miles.config.resolution import schema_args
from miles.io.loggers import IMAGE_KEY, MetricsLogger
from miles.io.video import as_video_frames, read_video

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


@pytest.fixture(scope="module", autouse=True)
def _offline_wandb_env(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("wandb_home")
    patch = pytest.MonkeyPatch()
    for name, value in _WANDB_ENV.items():
        patch.setenv(name, value)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        patch.setenv(name, str(home / name.lower()))
    for name in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        patch.delenv(name, raising=False)
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    patch.undo()


def make_args(**values: Any) -> Args:
    """Catalogue defaults (logging off) with `values` on top."""
    return schema_args(**values)


def _videos(n: int = 3, frames: int = 9, size: int = 16) -> list[torch.Tensor]:
    """[3, F, H, W] videos of 17 grey levels (exact in GIF as in lossless WebP)."""
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 17, (1, frames, size, size), generator=gen) / 16.0).expand(3, -1, -1, -1) for _ in range(n)
    ]


def test_video_samples_write_webp_grid_and_one_webp_each(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(diffusion_fps=4.0), tmp_path, "rl", echo=lambda line: None)
    videos = _videos()
    grid = logger.log_images(2, videos, ["the digit 1 moving left", "b", "c"])
    images = tmp_path / "images"
    assert grid == images / "rollout_2.png"
    with Image.open(grid) as png:
        assert png.format == "PNG" and png.size == (3 * 128, 128 + 28)
        first = np.asarray(png.convert("RGB"))
    with Image.open(images / "rollout_2.webp") as webp:
        assert webp.is_animated
        webp.seek(1)
        webp.load()
        assert webp.info["duration"] == 250  # --diffusion-fps 4
    animated = read_video(images / "rollout_2.webp")
    assert animated.shape == (9, 128 + 28, 3 * 128, 3) and np.array_equal(animated[0], first)
    per_sample = sorted((images / "rollout_2").iterdir())
    assert [p.name for p in per_sample] == ["0000.webp", "0001.webp", "0002.webp"]
    for path, video in zip(per_sample, videos, strict=True):
        decoded = read_video(path)
        assert decoded.shape == (9, 16, 16, 3) and np.array_equal(decoded, as_video_frames(video))
    logger.close()


def test_image_samples_write_only_the_png(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(), tmp_path, "rl", echo=lambda line: None)
    logger.log_images(0, [torch.rand(3, 8, 8) for _ in range(2)], ["a", "b"])
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["rollout_0.png"]
    logger.close()


def _tb_images(event_dir: Path) -> list[Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(event_dir), size_guidance={"images": 0})
    accumulator.Reload()
    return accumulator.Images(IMAGE_KEY)


def test_tensorboard_gets_an_animated_gif_for_videos_and_a_png_for_images(tmp_path: Path) -> None:
    logger = MetricsLogger(make_args(use_tensorboard=True), tmp_path, "rl", echo=lambda line: None)
    logger.log_images(0, [torch.rand(3, 8, 8)], ["an image"])
    videos = _videos(n=2, frames=5)
    logger.log_images(1, videos, ["v0", "v1"])
    logger.close()
    events = _tb_images(tmp_path / "tensorboard")
    assert [e.step for e in events] == [0, 1]
    with Image.open(io.BytesIO(events[0].encoded_image_string)) as still:
        assert still.format == "PNG" and (events[0].width, events[0].height) == still.size == (128, 156)
    with Image.open(io.BytesIO(events[1].encoded_image_string)) as gif:
        assert gif.format == "GIF" and gif.n_frames == 5 and (events[1].width, events[1].height) == (256, 156)
    gif_path = tmp_path / "tb.gif"
    gif_path.write_bytes(events[1].encoded_image_string)
    assert np.array_equal(read_video(gif_path), read_video(tmp_path / "images" / "rollout_1.webp"))


@pytest.mark.slow
def test_wandb_offline_logs_videos_as_gifs(tmp_path: Path) -> None:
    wandb_dir = tmp_path / "wb"
    args = make_args(
        use_wandb=True, wandb_mode="offline", wandb_dir=str(wandb_dir), wandb_project="t", wandb_log_num_images=2
    )
    logger = MetricsLogger(args, tmp_path / "out", "rl", echo=lambda line: None)
    videos = _videos(n=3, frames=6)
    logger.log_images(0, videos, ["a", "b", "c"])
    assert IMAGE_KEY in dict(logger.wandb_run.summary)
    logger.close()
    (run_dir,) = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    gifs = sorted((run_dir / "files" / "media" / "videos").rglob("*.gif"))
    assert len(gifs) == 2  # --wandb-log-num-images counts videos
    decoded = sorted((read_video(g) for g in gifs), key=lambda v: v.tobytes())
    expected = sorted((as_video_frames(v) for v in videos[:2]), key=lambda v: v.tobytes())
    for got, want in zip(decoded, expected, strict=True):
        assert got.shape == (6, 16, 16, 3) and np.array_equal(got, want)
