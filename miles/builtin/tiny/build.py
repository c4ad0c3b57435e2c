"""The frame every offline tiny build shares: the atomic output directory, the phase timer and its
progress bar, the build report, and the library versions recorded in each build's metadata."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the phases of every tiny build so far (a family with others sets `Progress.phases`)
PHASES = ("tokenizers", "text encoders", "transformer", "data", "vae fit", "vae stats", "classifier", "save")


@dataclass
class BuildReport:
    out_dir: Path
    seconds: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    classifier_test_accuracy: float = 0.0
    vae_test_mse: float = 0.0
    vae_recon_accuracy: float = 0.0
    params: dict[str, int] = field(default_factory=dict)


class Progress:
    """A rich progress bar over a build's phases (the VAE fit counts one unit per step), or nothing."""

    label = "tiny"
    phases: tuple[str, ...] = PHASES

    def __init__(self, enabled: bool, vae_steps: int, label: str | None = None, phases: tuple[str, ...] | None = None):
        self.label = label or self.label
        self.phases = phases or self.phases
        self.bar = None
        self.task = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(f"[bold]{self.label}[/] {{task.description}}"),
                BarColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("", total=len(self.phases) - 1 + vae_steps)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)


def pipeline_report(
    pipe: Any,
    out_dir: Path,
    start: float,
    timings: dict[str, float],
    classifier_accuracy: float,
    vae_test_mse: float,
    vae_recon_accuracy: float,
) -> BuildReport:
    """A finished build's report: its time since `start` (`time.perf_counter()`), the phases, the classifier's
    and the VAE's scores, and the parameter count of each torch component of `pipe`."""
    import torch

    params = {
        key: sum(p.numel() for p in module.parameters())
        for key, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }
    return BuildReport(
        out_dir=out_dir,
        seconds=round(time.perf_counter() - start, 3),
        phase_seconds=timings,
        classifier_test_accuracy=classifier_accuracy,
        vae_test_mse=vae_test_mse,
        vae_recon_accuracy=vae_recon_accuracy,
        params=params,
    )


def build_atomically(out_dir: str | Path, build_into: Callable[[Path], BuildReport]) -> BuildReport:
    """Every tiny build's frame: refuse a non-empty `out_dir`, run `build_into` in a temp sibling that is
    renamed into place (an interrupted build leaves nothing), and report the final directory."""
    from miles.utils.paths import atomic_directory

    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    with atomic_directory(out) as tmp:
        report = build_into(tmp)
    report.out_dir = out
    return report


def phase_timer(timings: dict[str, float], bar: Progress):
    """`with phase(name[, advance=False]):` shows `name` on `bar`, records its seconds in `timings` and
    advances the bar one unit (a phase that advances per step itself passes advance=False)."""

    @contextmanager
    def phase(name: str, advance: bool = True) -> Iterator[None]:
        bar.describe(name)
        t0 = time.perf_counter()
        yield
        timings[name] = round(time.perf_counter() - t0, 3)
        if advance:
            bar.advance()

    return phase


def library_versions() -> dict[str, str]:
    """The versions a tiny build's metadata records."""
    import diffusers
    import sklearn
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
    }


def score_and_save_classifier(out_dir: Path, recon_images: Any, test_labels: Any) -> tuple[dict[str, Any], float]:
    """Fit the digit reward's classifier, save it under `out_dir`, and score the VAE's test reconstructions
    (`[N, 3, H, W]` in [-1, 1]) with it: `(classifier metadata, reconstruction accuracy)`."""
    from miles.models import digit_classifier as digit

    clf, meta = digit.fit_digit_classifier()
    features = digit.digits_to_features(digit.images_to_digits(recon_images, "-1,1"))
    recon_accuracy = float((clf.predict(features) == test_labels).mean())
    meta["vae_reconstruction_accuracy"] = recon_accuracy
    digit.save_digit_classifier(clf, meta, out_dir / digit.CLASSIFIER_DIRNAME)
    return meta, recon_accuracy


def score_and_save_video_classifier(
    out_dir: Path, recon_videos: Any, test_labels: Any, directions: list[str]
) -> tuple[dict[str, Any], float, float]:
    """Fit the VIDEO digit classifier (`fit_digit_classifier(video=True)`), save it under `out_dir`, and score a
    video VAE's test reconstructions (`[N, 3, F, H, W]` in [-1, 1]): `(classifier metadata, per-frame digit
    accuracy, direction accuracy)`; the direction is `track_direction` of each decoded video."""
    import numpy as np

    from miles.data.digits_video import track_direction
    from miles.models import digit_classifier as digit

    clf, meta = digit.fit_digit_classifier(video=True)
    videos = recon_videos.detach().float().cpu().numpy()
    frames = videos.shape[2]
    features = digit.digits_to_features(digit.videos_to_digits(videos, "-1,1"))
    frame_accuracy = float((clf.predict(features) == np.repeat(np.asarray(test_labels), frames)).mean())
    tracked = [track_direction((v + 1.0) / 2.0) for v in videos]
    direction_accuracy = float(np.mean([t == d for t, d in zip(tracked, directions, strict=True)]))
    meta["vae_reconstruction_accuracy"] = frame_accuracy
    meta["vae_direction_accuracy"] = direction_accuracy
    digit.save_digit_classifier(clf, meta, out_dir / digit.CLASSIFIER_DIRNAME)
    return meta, frame_accuracy, direction_accuracy
