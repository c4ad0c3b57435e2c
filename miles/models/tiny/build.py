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

    def __init__(self, enabled: bool, vae_steps: int):
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
