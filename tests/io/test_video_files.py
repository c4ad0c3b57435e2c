"""Video files (`miles.io.video`): animated WebP/GIF written and read back frame-exact, layouts, grids, the
SFT reader (centre crop, resize, frame stride) and the media a rollout writes for people to open."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from miles.config.resolution import schema_args
from miles.core.errors import ConfigError
from miles.io.images import grid_sheet
from miles.io.video import (
    as_video_frames,
    encode_video,
    frames_to_sample,
    is_video,
    load_sft_video,
    read_video,
    save_samples_media,
    save_video_grid,
    video_grid,
    write_video,
)


def _random_video(frames: int = 6, h: int = 12, w: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.rand(3, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _few_colour_video(frames: int = 7, h: int = 16, w: int = 16) -> np.ndarray:
    """[3, F, H, W] in [0, 1] with 17 grey levels (as the digits): GIF-exact too."""
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 17, size=(frames, h, w)) / 16.0
    return np.repeat(gray[None], 3, axis=0).astype(np.float32)


def test_layouts_to_frames() -> None:
    video = _random_video()
    frames = as_video_frames(video)
    assert frames.shape == (6, 12, 20, 3) and frames.dtype == np.uint8
    expected = np.rint(video.permute(1, 2, 3, 0).numpy() * 255).astype(np.uint8)
    assert np.array_equal(frames, expected)
    assert np.array_equal(as_video_frames(video.permute(1, 0, 2, 3)), frames)  # [F, 3, H, W]
    assert np.array_equal(as_video_frames(frames), frames)  # [F, H, W, 3] uint8
    grey = as_video_frames(video[:1])  # one channel: repeated to RGB
    assert np.array_equal(grey[..., 0], frames[..., 0]) and np.array_equal(grey[..., 2], frames[..., 0])
    back = frames_to_sample(frames)
    assert back.shape == (3, 6, 12, 20) and torch.allclose(back, video, atol=0.5 / 255 + 1e-6)
    assert is_video(video) and not is_video(video[:, 0]) and not is_video(Image.new("RGB", (4, 4)))
    with pytest.raises(ValueError, match="4 dims"):
        as_video_frames(video[:, 0])


@pytest.mark.parametrize("suffix", [".webp", ".gif"])
def test_write_read_roundtrip_frame_exact(tmp_path, suffix) -> None:
    video = _few_colour_video()
    video[:, 3] = video[:, 2]  # identical consecutive frames: encoders merge them, the reader expands them back
    video[:, 4] = video[:, 2]
    path = write_video(tmp_path / f"v{suffix}", video, fps=8)
    with Image.open(path) as image:
        assert image.format == suffix[1:].upper() and getattr(image, "is_animated", False)
        assert image.n_frames == 5  # 7 frames, 3 of them the same: stored as 5
    frames = read_video(path)
    assert frames.shape == (7, 16, 16, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames, as_video_frames(video))
    floats = read_video(path, dtype="float32")
    assert floats.dtype == np.float32 and np.allclose(floats, as_video_frames(video) / 255.0)


def test_webp_is_lossless_for_any_colours(tmp_path) -> None:
    video = _random_video(frames=9, h=64, w=64)
    assert np.array_equal(read_video(write_video(tmp_path / "r.webp", video)), as_video_frames(video))
    gif = read_video(write_video(tmp_path / "r.gif", video))  # 256-colour palette: close, not exact
    assert gif.shape == (9, 64, 64, 3)
    assert np.abs(gif.astype(int) - as_video_frames(video).astype(int)).mean() < 16


@pytest.mark.parametrize("suffix", [".webp", ".gif"])
def test_a_still_video_keeps_its_frame_count(tmp_path, suffix) -> None:
    video = torch.full((3, 9, 8, 8), 0.5)
    frames = read_video(write_video(tmp_path / f"still{suffix}", video))
    assert frames.shape == (9, 8, 8, 3) and (frames == 128).all()


def test_foreign_files_and_errors(tmp_path) -> None:
    # an animated WebP written elsewhere (no miles metadata): its stored frames
    frames = [Image.fromarray(np.full((4, 4, 3), 40 * k, np.uint8)) for k in range(3)]
    frames[0].save(tmp_path / "x.webp", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    got = read_video(tmp_path / "x.webp")
    assert got.shape == (3, 4, 4, 3) and got[:, 0, 0, 0].tolist() == [0, 40, 80]
    Image.new("RGB", (5, 4), "red").save(tmp_path / "still.png")
    assert read_video(tmp_path / "still.png").shape == (1, 4, 5, 3)
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 16)
    import importlib.util

    if importlib.util.find_spec("av") is None:
        with pytest.raises(ValueError, match=r"cannot read .*clip\.mp4: only animated WebP and GIF"):
            read_video(tmp_path / "clip.mp4")
    with pytest.raises(FileNotFoundError, match=r"nope\.webp"):
        read_video(tmp_path / "nope.webp")
    with pytest.raises(ValueError, match=r"written as \.webp or \.gif"):
        write_video(tmp_path / "v.mp4", _random_video())
    with pytest.raises(ValueError, match="fps"):
        encode_video(_random_video(), "webp", fps=0)


def test_frame_timing_follows_fps(tmp_path) -> None:
    video = _random_video(frames=4, h=8, w=8)
    for suffix, fps, ms in ((".webp", 8, 125), (".webp", 16, 62), (".gif", 8, 120), (".gif", 100, 20)):
        with Image.open(write_video(tmp_path / f"t{fps}{suffix}", video, fps=fps)) as image:
            image.seek(1)
            image.load()
            assert image.info["duration"] == ms, (suffix, fps)


def test_sft_reader_crops_resizes_and_strides(tmp_path) -> None:
    # 9 frames of 40x60 (W > H): frame k is the constant 20 * k, plus marker columns outside the centre square
    video = np.zeros((9, 40, 60, 3), np.uint8)
    for k in range(9):
        video[k] = 20 * k
        video[k, :, :2] = 255  # the centre 40x40 crop keeps columns 10..49 only
    video[:, 5:7, 20:30] = 200  # and something inside it
    path = write_video(tmp_path / "s.webp", video)
    full = load_sft_video(path, (40, 40))
    assert full.shape == (9, 40, 40, 3) and full.dtype == np.float32
    assert np.array_equal(full, video[:, :, 10:50] / np.float32(255.0))  # cropped, not resized
    strided = load_sft_video(path, (40, 40), frame_stride=3)  # --sft-frame-stride 3: frames 0, 3, 6
    assert strided.shape == (3, 40, 40, 3) and np.array_equal(strided, full[::3])
    small = load_sft_video(path, (8, 16), frame_stride=2, num_frames=4)  # frames 0, 2, 4, 6 at 8x16
    assert small.shape == (4, 8, 16, 3)
    levels = (20 * np.arange(0, 8, 2) / 255.0)[:, None, None, None]
    assert np.allclose(small[:, 4:], levels, atol=1.5 / 255)  # the constant rows below the inside marker
    with pytest.raises(ConfigError, match="SFT video not found"):
        load_sft_video(tmp_path / "missing.webp", (8, 8))
    with pytest.raises(ConfigError, match="--sft-frame-stride"):
        load_sft_video(path, (8, 8), frame_stride=0)
    with pytest.raises(ConfigError, match="5 frames at stride 2, need 6"):
        load_sft_video(path, (8, 8), frame_stride=2, num_frames=6)


def test_video_grid_is_the_image_grid_frame_by_frame(tmp_path) -> None:
    videos = [_random_video(frames=3, h=16, w=16, seed=s) for s in range(3)]
    image = torch.rand(3, 16, 16)  # an image in a video grid holds still
    short = _random_video(frames=2, h=16, w=16, seed=9)  # a shorter video holds its last frame
    items, labels = [*videos, image, short], ["a", "b", "c", "still", "short"]
    grid = video_grid(items, labels, columns=3, size=32)
    assert grid.shape == (3, 2 * (32 + 28), 3 * 32, 3)
    for f in range(3):
        tiles = [v[:, f] for v in videos] + [image, short[:, min(f, 1)]]
        assert np.array_equal(grid[f], np.asarray(grid_sheet(tiles, labels, 3, 32)))
    path = save_video_grid(tmp_path / "g.webp", items, labels, columns=3, size=32)
    assert np.array_equal(read_video(path), grid)
    with pytest.raises(ValueError, match="labels"):
        video_grid(items, labels[:2])


def test_samples_media_for_images_and_videos(tmp_path) -> None:
    images = [torch.rand(3, 16, 16) for _ in range(2)]
    written = save_samples_media(tmp_path, "eval_x", images, ["a", "b"])
    assert written["grid"] == tmp_path / "eval_x.png" and written["video_grid"] is None and written["videos"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_x.png"]

    videos = [_random_video(frames=5, h=16, w=16, seed=s) for s in range(3)]
    written = save_samples_media(tmp_path, "rollout_3", videos, ["p0", "p1", "p2"], fps=4)
    with Image.open(written["grid"]) as png:
        assert png.format == "PNG" and png.size == (3 * 128, 128 + 28)
        first = np.asarray(png.convert("RGB"))
    assert written["video_grid"] == tmp_path / "rollout_3.webp"
    grid = read_video(written["video_grid"])
    assert grid.shape == (5, 128 + 28, 3 * 128, 3) and np.array_equal(grid[0], first)
    assert [p.name for p in written["videos"]] == ["0000.webp", "0001.webp", "0002.webp"]
    for path, video in zip(written["videos"], videos, strict=True):
        assert np.array_equal(read_video(path), as_video_frames(video))


def test_eval_of_videos_writes_the_animated_grid_and_each_video(tmp_path) -> None:
    """Eval (miles eval and the jobs' --eval-interval) writes videos as rollouts do, at --diffusion-fps."""

    from miles.core.sample import Sample
    from miles.runtime.eval_job import save_eval_grids

    videos = [_random_video(frames=4, h=16, w=16, seed=s) for s in range(2)]
    samples = [Sample(index=i, group_index=i, prompt=f"p{i}", image=v, reward=0.5) for i, v in enumerate(videos)]
    args = schema_args(eval_reward_key=None, reward_key=None, diffusion_fps=4)
    save_eval_grids(args, tmp_path, {"digits": samples}, tag="_7")
    images = tmp_path / "images"
    assert sorted(p.name for p in images.iterdir()) == ["eval_digits_7", "eval_digits_7.png", "eval_digits_7.webp"]
    assert read_video(images / "eval_digits_7.webp").shape[0] == 4
    for k in range(len(videos)):
        assert read_video(images / "eval_digits_7" / f"{k:04d}.webp").shape == (4, 16, 16, 3)
    with Image.open(images / "eval_digits_7.webp") as webp:
        webp.seek(1)
        webp.load()
        assert webp.info["duration"] == 250  # 4 fps
