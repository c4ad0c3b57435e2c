"""`MetricsLogger`: one call per rollout fans metrics out to stdout, `metrics.jsonl`, TensorBoard and wandb.

    logger = MetricsLogger(args, output_dir, job="rl")
    logger.log(rollout_id, metrics)                      # every rollout
    logger.log_images(rollout_id, images, captions)      # every rollout; it keeps --wandb-log-image-interval
    logger.close()                                       # finish wandb/TensorBoard, write curves.png

Always: a summary line on stdout and a row in `<output-dir>/metrics.jsonl`; image grids in `<output-dir>/images/`
(videos: an animated WebP grid and one WebP per sample besides, `miles.io.video.save_samples_media`).
With `--use-tensorboard`: scalars under `--tensorboard-dir` (default `<output-dir>/tensorboard`), step = rollout_id,
and the image grid (an animated GIF for videos).
With `--use-wandb`: a wandb run (mode from `--wandb-mode`, which overrides `WANDB_MODE`), metrics keyed to the
`rollout_id` step metric, and up to `--wandb-log-num-images` samples as `rollout_media/sample_images` (videos as
GIF `wandb.Video`s).
torch, tensorboard, wandb and matplotlib are imported only when used.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles.io.metrics import MetricsWriter, summary_line
from miles.io.plots import plot_curves

IMPORTANT_KEYS = (
    "rollout/reward/raw_mean",
    "train/loss",
    "train/kl_loss",
    "train/grad_norm",
    "train/log_prob_mean_abs_diff",
)
SUMMARY_PREFIXES = ("perf/", "eval/")
IMAGE_KEY = "rollout_media/sample_images"
CURVES_FILE = "curves.png"
# Never sent to wandb as config.
_SECRET_ARGS = frozenset({"wandb_key"})


def summary_keys(metrics: dict[str, Any]) -> tuple[str, ...]:
    """The keys of the stdout line: the important ones, then perf/* and eval/* (sorted), when present."""
    keys = [key for key in IMPORTANT_KEYS if key in metrics]
    for prefix in SUMMARY_PREFIXES:
        keys += sorted(key for key in metrics if key.startswith(prefix))
    return tuple(keys)


def run_name(job: str, random_suffix: bool = True) -> str:
    """`<job>-<YYYYmmdd-HHMMSS>`, plus `-<6 hex>` unless disabled (does not touch the seeded RNGs)."""
    name = f"{job}-{time.strftime('%Y%m%d-%H%M%S')}"
    return f"{name}-{secrets.token_hex(3)}" if random_suffix else name


class MetricsLogger:
    def __init__(
        self,
        args: Any,
        output_dir: str | os.PathLike,
        job: Any = None,
        *,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        """job: the job name (or anything with `.name`, e.g. a JobSpec); default `args.job`.
        echo: where the summary line goes (default: print to stdout, flushed)."""
        self.args = args
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.job = _job_name(job, args)
        self._echo = echo or (lambda line: print(line, file=sys.stdout, flush=True))
        self._writer = MetricsWriter(self.output_dir)
        self._tb: Any = None
        self._wandb_run: Any = None
        self._closed = False
        if _arg(args, "use_tensorboard", False):
            self._init_tensorboard()
        if _arg(args, "use_wandb", False):
            self._init_wandb()

    # ------------------------------------------------------------------ setup

    @property
    def metrics_path(self) -> Path:
        return self._writer.path

    @property
    def tensorboard_dir(self) -> Path:
        return Path(_arg(self.args, "tensorboard_dir", None) or self.output_dir / "tensorboard")

    @property
    def wandb_run(self) -> Any:
        """The live wandb run (None when wandb is off or closed)."""
        return self._wandb_run

    def _init_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))

    def _init_wandb(self) -> None:
        import wandb

        args = self.args
        # Host and key travel through the environment, as wandb reads them.
        if _arg(args, "wandb_host", None):
            os.environ["WANDB_BASE_URL"] = str(args.wandb_host)
        if _arg(args, "wandb_key", None):
            os.environ["WANDB_API_KEY"] = str(args.wandb_key)
        wandb_dir = Path(_arg(args, "wandb_dir", None) or "./wandb")
        wandb_dir.mkdir(parents=True, exist_ok=True)
        run_id = _arg(args, "wandb_run_id", None)
        self._wandb_run = wandb.init(
            project=_arg(args, "wandb_project", None),
            group=_arg(args, "wandb_group", None),
            entity=_arg(args, "wandb_team", None),
            id=run_id,
            resume="allow" if run_id else None,
            name=run_name(self.job, random_suffix=not _arg(args, "disable_wandb_random_suffix", False)),
            job_type=self.job,
            dir=str(wandb_dir),
            # None lets WANDB_MODE decide; an explicit --wandb-mode wins over it.
            mode=_arg(args, "wandb_mode", None),
            config=_config_dict(args),
            reinit="finish_previous",
        )
        # Every metric is plotted against rollout_id, so resumed or sparse logging never fights wandb's own step.
        self._wandb_run.define_metric("rollout_id")
        self._wandb_run.define_metric("*", step_metric="rollout_id")

    # ------------------------------------------------------------------ logging

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> str:
        """Log one rollout's metrics everywhere; returns the summary line it echoed."""
        plain = {key: _scalar(value) for key, value in metrics.items()}
        self._writer.write(rollout_id, plain)
        line = summary_line(rollout_id, plain, summary_keys(plain))
        self._echo(line)
        numeric = {key: value for key, value in plain.items() if _is_number(value)}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, float(value), global_step=rollout_id)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({**numeric, "rollout_id": rollout_id})
        return line

    def should_log_images(self, rollout_id: int) -> bool:
        interval = max(1, int(_arg(self.args, "wandb_log_image_interval", 1) or 1))
        return rollout_id % interval == 0

    def log_images(self, rollout_id: int, images: Sequence[Any], captions: Sequence[str]) -> Path | None:
        """Every `--wandb-log-image-interval` rollouts: `images/rollout_{id}.png` (all samples, captioned), and
        the first `--wandb-log-num-images` to wandb. Images: `[3, H, W]` in [0, 1] (tensor, array or PIL).

        Videos (`[3, F, H, W]` in [0, 1]) show their first frame in the PNG and add `images/rollout_{id}.webp`
        (the captioned grid, animated) and `images/rollout_{id}/NNNN.webp` (one per video sample), at
        `--diffusion-fps` (default 8); wandb gets them as GIF `wandb.Video`s (they count towards
        `--wandb-log-num-images`). With TensorBoard, the grid goes to `rollout_media/sample_images` (a PNG, or
        an animated GIF for videos). Returns the PNG grid path, or None when skipped."""
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} images but {len(captions)} captions")
        if not images or not self.should_log_images(rollout_id):
            return None
        from miles.io.video import DEFAULT_FPS, save_samples_media

        fps = float(_arg(self.args, "diffusion_fps", None) or DEFAULT_FPS)
        written = save_samples_media(self.output_dir / "images", f"rollout_{rollout_id}", images, captions, fps)
        if self._tb is not None:
            self._tb_grid(rollout_id, written, fps)
        num = int(_arg(self.args, "wandb_log_num_images", 0) or 0)
        if self._wandb_run is not None and num > 0:
            media = [self._wandb_media(i, c, fps) for i, c in zip(images[:num], captions[:num], strict=True)]
            self._wandb_run.log({IMAGE_KEY: media, "rollout_id": rollout_id})
        return written["grid"]

    def _tb_grid(self, rollout_id: int, written: dict[str, Any], fps: float) -> None:
        """The grid as a TensorBoard image summary: the PNG, or an animated GIF (its image plugin plays it)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        from miles.io.video import encode_video

        if written["grid_frames"] is not None:
            frames = written["grid_frames"]
            height, width, data = frames.shape[1], frames.shape[2], encode_video(frames, "gif", fps)
        else:
            data = Path(written["grid"]).read_bytes()
            from PIL import Image

            with Image.open(written["grid"]) as image:
                width, height = image.size
        image = Summary.Image(height=int(height), width=int(width), colorspace=3, encoded_image_string=data)
        summary = Summary(value=[Summary.Value(tag=IMAGE_KEY, image=image)])
        self._tb._get_file_writer().add_summary(summary, global_step=rollout_id)
        self._tb.flush()

    def _wandb_media(self, image: Any, caption: str, fps: float) -> Any:
        import io

        import wandb

        from miles.io.video import encode_video, is_video

        if is_video(image):  # wandb encodes numpy video with moviepy (absent): hand it a GIF instead
            return wandb.Video(io.BytesIO(encode_video(image, "gif", fps)), caption=caption, format="gif")
        tensor = _to_tensor(image)
        pixels = (tensor.detach().float().clamp(0, 1) * 255).round().byte().cpu().numpy()
        return wandb.Image(pixels.transpose(1, 2, 0), caption=caption)

    # ------------------------------------------------------------------ teardown

    def close(self) -> Path | None:
        """Finish wandb, close TensorBoard and write `<output-dir>/curves.png`. Safe to call twice."""
        if self._closed:
            return None
        self._closed = True
        try:
            if self._wandb_run is not None:
                self._wandb_run.finish()
        finally:
            self._wandb_run = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
        return plot_curves(self.metrics_path, self.output_dir / CURVES_FILE, title=self.job)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _arg(args: Any, name: str, default: Any) -> Any:
    return getattr(args, name, default)


def _job_name(job: Any, args: Any) -> str:
    if job is None:
        job = getattr(args, "job", None) or "miles"
    return str(getattr(job, "name", job))


def _config_dict(args: Any) -> dict[str, Any]:
    if hasattr(args, "to_dict"):
        values = args.to_dict()
    elif isinstance(args, dict):
        values = dict(args)
    else:
        values = dict(vars(args))
    if getattr(args, "job", None) is not None:
        values.setdefault("job", args.job)
    return {key: value for key, value in values.items() if key not in _SECRET_ARGS}


def _scalar(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; everything else as is."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _is_number(value: Any) -> bool:
    """Ints and floats (NaN and inf included: a diverging loss is worth seeing), not bools."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_tensor(image: Any) -> Any:
    import torch

    if isinstance(image, torch.Tensor):
        return image
    import numpy as np

    array = np.asarray(image)
    if array.dtype == np.uint8:
        array = array.astype(np.float32) / 255.0
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if tensor.dim() == 3 and tensor.shape[-1] in (1, 3, 4) and tensor.shape[0] not in (1, 3, 4):
        tensor = tensor.permute(2, 0, 1)  # HWC (PIL / numpy) -> CHW
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.shape[-3] == 1:
        tensor = tensor.expand(*tensor.shape[:-3], 3, *tensor.shape[-2:])
    elif tensor.shape[-3] == 4:
        tensor = tensor[..., :3, :, :]
    return tensor
