"""Video files for people and for SFT data: animated WebP (lossless) and GIF, written and read with PIL.

Layouts:
  * a video sample (`Sample.image` of a video job) is a float tensor/array `[3, F, H, W]` in [0, 1];
  * files decode to `[F, H, W, 3]` (uint8, or float32 in [0, 1]).
`as_video_frames` brings any of `[3|1, F, H, W]`, `[F, 3|1|4, H, W]` or `[F, H, W, 3]` (uint8, or float when
F is not 1, 3 or 4) to `[F, H, W, 3]` uint8.

Encoders merge identical consecutive frames into one longer frame (both PIL's GIF writer and libwebp's
animation encoder do), so a file written here records its frame duration and frame count in its metadata
(GIF comment, WebP XMP: `miles-video frame_ms=<ms> frames=<F>`) and `read_video` expands every stored frame
by its duration: a video decodes back to exactly its F frames (WebP: bit-exact; GIF: exact for at most 256
colours a frame). Other files decode to the frames as stored.

`.mp4` and other containers are read only when PyAV (`av`) is installed.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from miles.utils.atomic import atomic_open

DEFAULT_FPS = 8
VIDEO_SUFFIXES = (".webp", ".gif")
_TAG = "miles-video"
_TAG_RE = re.compile(rb"miles-video frame_ms=(\d+) frames=(\d+)")
_FORMATS = {".webp": "webp", ".gif": "gif"}


# ---- layouts ----------------------------------------------------------------------------------
def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        x = x.numpy() if str(x.dtype) == "torch.uint8" else x.float().numpy()
    return np.asarray(x)


def is_video(x: Any) -> bool:
    """A video sample (4-D: `[3, F, H, W]` and the other layouts `as_video_frames` reads); images are 2-/3-D."""
    return len(getattr(x, "shape", ())) == 4


def as_video_frames(video: Any) -> np.ndarray:
    """A video in any layout of the module docstring -> `[F, H, W, 3]` uint8 (floats: x 255, rounded)."""
    arr = _to_numpy(video)
    if arr.ndim != 4:
        raise ValueError(f"a video has 4 dims ([3, F, H, W]), got shape {arr.shape}")
    if arr.dtype == np.uint8 and arr.shape[-1] in (1, 3, 4):
        fhwc = arr
    elif arr.shape[0] in (1, 3):
        fhwc = arr.transpose(1, 2, 3, 0)  # [C, F, H, W], the sample layout
    elif arr.shape[1] in (1, 3, 4):
        fhwc = arr.transpose(0, 2, 3, 1)  # [F, C, H, W]
    elif arr.shape[-1] in (1, 3, 4):
        fhwc = arr
    else:
        raise ValueError(f"cannot read a video of shape {arr.shape}: expected [3, F, H, W]")
    if fhwc.dtype != np.uint8:
        fhwc = np.clip(np.rint(fhwc.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)
    channels = fhwc.shape[-1]
    if channels == 1:
        fhwc = np.repeat(fhwc, 3, axis=-1)
    elif channels == 4:
        fhwc = fhwc[..., :3]
    return np.ascontiguousarray(fhwc)


def frames_to_sample(frames: np.ndarray) -> Any:
    """`[F, H, W, 3]` (uint8 or float in [0, 1]) -> the sample layout, a float32 torch tensor `[3, F, H, W]`."""
    import torch

    arr = np.asarray(frames)
    arr = arr.astype(np.float32) / 255.0 if arr.dtype == np.uint8 else arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(3, 0, 1, 2)))


# ---- writing ----------------------------------------------------------------------------------
def _frame_ms(fmt: str, fps: float) -> int:
    if not fps or fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    if fmt == "gif":  # GIF stores centiseconds; players clamp anything under 20 ms
        return max(20, 10 * round(100.0 / fps))
    return max(1, round(1000.0 / fps))


def encode_video(video: Any, fmt: str = "webp", fps: float = DEFAULT_FPS) -> bytes:
    """A video (any layout `as_video_frames` reads) -> the bytes of an animated lossless WebP or a GIF."""
    from PIL import Image

    if fmt not in ("webp", "gif"):
        raise ValueError(f"video format must be 'webp' or 'gif', got {fmt!r}")
    frames = as_video_frames(video)
    ms = _frame_ms(fmt, fps)
    tag = f"{_TAG} frame_ms={ms} frames={len(frames)}".encode()
    images = [Image.fromarray(f, "RGB") for f in frames]
    buffer = io.BytesIO()
    extra: dict[str, Any] = (
        {"lossless": True, "quality": 100, "method": 4, "xmp": tag}
        if fmt == "webp"
        else {
            "comment": tag,
            "optimize": False,
        }
    )
    images[0].save(buffer, format=fmt.upper(), save_all=True, append_images=images[1:], duration=ms, loop=0, **extra)
    return buffer.getvalue()


def write_video(path: str | os.PathLike, video: Any, fps: float = DEFAULT_FPS) -> Path:
    """Write a video as an animated WebP (lossless) or GIF, chosen by the suffix of `path` (atomically)."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: videos are written as {' or '.join(VIDEO_SUFFIXES)}")
    data = encode_video(video, fmt, fps)
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return path


# ---- reading ----------------------------------------------------------------------------------
def _read_pil(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        meta = im.info.get("xmp") or im.info.get("comment") or b""
        tagged = _TAG_RE.search(meta if isinstance(meta, bytes) else str(meta).encode())
        frames, repeats = [], []
        for i in range(getattr(im, "n_frames", 1)):
            im.seek(i)
            im.load()
            frames.append(np.array(im.convert("RGB"), dtype=np.uint8))
            duration = im.info.get("duration") or 0
            repeats.append(max(1, round(duration / int(tagged.group(1)))) if tagged else 1)
    if tagged and len(frames) == 1:  # every frame was the same: the encoder wrote a still image
        repeats = [int(tagged.group(2))]
    out = np.stack([f for f, n in zip(frames, repeats, strict=True) for _ in range(n)])
    if tagged and len(out) != int(tagged.group(2)):
        raise ValueError(f"{path}: decoded {len(out)} frames, its metadata says {int(tagged.group(2))}")
    return out


def _read_av(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: no video frames")
    return np.stack(frames)


def read_video(path: str | os.PathLike, dtype: str = "uint8") -> np.ndarray:
    """A video file -> `[F, H, W, 3]`: `dtype` "uint8", or "float32" in [0, 1].

    Animated WebP and GIF are read with PIL (a still image reads as one frame); any other file (`.mp4`, ...)
    needs PyAV (`pip install av`), and without it is a ValueError naming the file."""
    if dtype not in ("uint8", "float32"):
        raise ValueError(f"dtype must be 'uint8' or 'float32', got {dtype!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no video file at {path}")
    if path.suffix.lower() in (".webp", ".gif", ".png", ".apng"):
        frames = _read_pil(path)
    else:
        import importlib.util

        if importlib.util.find_spec("av") is None:
            raise ValueError(
                f"cannot read {path}: only animated WebP and GIF videos are read without PyAV "
                "(`pip install av` reads .mp4 and other containers)"
            )
        frames = _read_av(path)
    return frames if dtype == "uint8" else frames.astype(np.float32) / 255.0


def load_sft_video(
    path: str | os.PathLike, size: tuple[int, int], frame_stride: int = 1, num_frames: int | None = None
) -> np.ndarray:
    """An SFT row's video at the training size: `[F, H, W, 3]` float32 in [0, 1].

    Frames 0, k, 2k, ... are kept (`--sft-frame-stride k`), then the first `num_frames` when given; each
    frame is centre-cropped to a square and resized (bicubic) to `size` = (`--diffusion-height`,
    `--diffusion-width`), as SFT images are. A missing file is a ConfigError naming it."""
    from PIL import Image

    from miles.core.errors import ConfigError

    path = Path(path)
    if int(frame_stride) < 1:
        raise ConfigError(f"--sft-frame-stride must be at least 1, got {frame_stride}")
    if not path.is_file():
        raise ConfigError(f"SFT video not found: {path}")
    frames = read_video(path)[:: int(frame_stride)]
    if num_frames is not None:
        if len(frames) < num_frames:
            raise ConfigError(f"SFT video {path}: {len(frames)} frames at stride {frame_stride}, need {num_frames}")
        frames = frames[:num_frames]
    height, width = int(size[0]), int(size[1])
    out = np.empty((len(frames), height, width, 3), dtype=np.float32)
    for i, frame in enumerate(frames):
        image = Image.fromarray(frame)
        w, h = image.size
        side = min(w, h)
        image = image.crop(((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2))
        image = image.resize((width, height), Image.BICUBIC)
        out[i] = np.asarray(image, dtype=np.float32) / 255.0
    return out


# ---- grids ------------------------------------------------------------------------------------
def _media_frames(item: Any) -> np.ndarray:
    """A video, or an image (`[3, H, W]` / HWC / PIL: one frame) -> `[F, H, W, 3]` uint8."""
    if hasattr(item, "convert") and hasattr(item, "size"):  # PIL.Image
        return np.array(item.convert("RGB"), dtype=np.uint8)[None]
    arr = _to_numpy(item)
    if arr.ndim == 4:
        return as_video_frames(arr)
    if arr.ndim == 2:
        arr = arr[..., None]
    elif arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)  # CHW -> HWC
    if arr.ndim != 3:
        raise ValueError(f"cannot read an image or video of shape {arr.shape}")
    if arr.dtype != np.uint8:
        arr = np.clip(np.rint(arr.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)
    arr = np.repeat(arr, 3, axis=-1) if arr.shape[-1] == 1 else arr[..., :3]
    return np.ascontiguousarray(arr)[None]


def video_grid(videos: Sequence[Any], labels: Sequence[str], columns: int = 8, size: int = 128) -> np.ndarray:
    """Several videos as one `[F, H, W, 3]` uint8 grid video, each frame the captioned grid `save_grid` draws
    (`miles.io.images.grid_sheet`); F is the longest video's, shorter ones (and images) hold their last frame."""
    import torch

    from miles.io.images import grid_sheet

    if len(videos) != len(labels):
        raise ValueError(f"{len(videos)} videos but {len(labels)} labels")
    clips = [_media_frames(v) for v in videos]
    num_frames = max((len(c) for c in clips), default=0)
    sheets = []
    for f in range(num_frames):
        tiles = [torch.from_numpy(c[min(f, len(c) - 1)]).permute(2, 0, 1).float() / 255.0 for c in clips]
        sheets.append(np.asarray(grid_sheet(tiles, labels, columns, size), dtype=np.uint8))
    return np.stack(sheets)


def save_video_grid(
    path: str | os.PathLike,
    videos: Sequence[Any],
    labels: Sequence[str],
    columns: int = 8,
    size: int = 128,
    fps: float = DEFAULT_FPS,
) -> Path:
    """`video_grid` written as an animated WebP or GIF (by the suffix of `path`)."""
    return write_video(path, video_grid(videos, labels, columns, size), fps)


def save_samples_media(
    folder: str | os.PathLike,
    stem: str,
    images: Sequence[Any],
    labels: Sequence[str],
    fps: float = DEFAULT_FPS,
    columns: int = 8,
    size: int = 128,
) -> dict[str, Any]:
    """What a rollout or eval writes for people to open, under `folder`:
        `<stem>.png`          the captioned grid (a video shows its first frame), always;
        `<stem>.webp`         with any video: the captioned grid as an animated WebP;
        `<stem>/NNNN.webp`    with any video: one animated WebP per video sample (NNNN its index).
    Images: `[3, H, W]` in [0, 1] (tensor, array or PIL); videos: `[3, F, H, W]`.
    Returns {"grid": png path, "video_grid": webp path or None, "videos": [per-sample paths],
    "grid_frames": the grid video `[F, H, W, 3]` uint8 or None} (the logger re-encodes these for wandb/TB)."""
    import torch

    from miles.io.images import save_grid

    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    folder = Path(folder)
    clips = [_media_frames(image) for image in images]
    stills = [torch.from_numpy(c[0]).permute(2, 0, 1).float() / 255.0 for c in clips]
    out: dict[str, Any] = {"grid": save_grid(folder / f"{stem}.png", stills, list(labels), columns, size)}
    out.update(video_grid=None, videos=[], grid_frames=None)
    video_idx = [k for k, image in enumerate(images) if is_video(image)]
    if video_idx:
        frames = video_grid(clips, list(labels), columns, size)
        out["grid_frames"] = frames
        out["video_grid"] = write_video(folder / f"{stem}.webp", frames, fps)
        out["videos"] = [write_video(folder / stem / f"{k:04d}.webp", clips[k], fps) for k in video_idx]
    return out
