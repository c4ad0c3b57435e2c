"""`miles data ...`: generate the built-in data sets. Torch-free at import."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miles.core.errors import ConfigError

app = typer.Typer(help="Generate the built-in data sets (offline).", no_args_is_help=True)


@app.callback()
def _data() -> None:
    """Generate the built-in data sets (offline)."""


@app.command("digits")
def digits(
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to write into (default: $MILES_HOME/data/digits)."),
    ] = None,
) -> None:
    """Write scikit-learn's digits as prompt JSONL (train/test) and a 64x64 image+caption SFT set."""
    if out is None:
        from miles.builtin.datasets import resolve_dataset
        from miles.builtin.names import builtin_dataset_names

        paths = {spec: resolve_dataset(spec) for spec in builtin_dataset_names() if spec.startswith("digits:")}
    else:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a directory")
        from miles.data.digits import write_digits_data

        paths = {f"digits:{k}": v for k, v in write_digits_data(out.expanduser()).items()}
    for spec, path in paths.items():
        typer.echo(f"{spec:<16} {path}")


@app.command("digits-video")
def digits_video(
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to write into (default: $MILES_HOME/data/digits-video)."),
    ] = None,
) -> None:
    """Write moving digits (one digit crossing a 64x64 frame in 9 frames, in a prompted direction) as prompt
    JSONL (train/test/labels) and a video+caption SFT set of animated WebPs."""
    if out is None:
        from miles.builtin.datasets import resolve_dataset
        from miles.builtin.names import builtin_dataset_names

        paths = {spec: resolve_dataset(spec) for spec in builtin_dataset_names() if spec.startswith("digits-video:")}
    else:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a directory")
        from miles.data.digits_video import write_digits_video_data

        paths = {f"digits-video:{k}": v for k, v in write_digits_video_data(out.expanduser()).items()}
    for spec, path in paths.items():
        typer.echo(f"{spec:<22} {path}")


@app.command("digits-preference")
def digits_preference(
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to write into (default: $MILES_HOME/data/digits-preference)."),
    ] = None,
) -> None:
    """Write a preference set for offline DPO (`train sft --loss-type dpo`): per digits example its prompt, its own
    image as `chosen` and an image of another digit as `rejected` (train/test JSONL and the 64x64 PNGs)."""
    if out is None:
        from miles.builtin.datasets import resolve_dataset
        from miles.builtin.names import builtin_dataset_names

        names = [spec for spec in builtin_dataset_names() if spec.startswith("digits-preference:")]
        paths = {spec: resolve_dataset(spec) for spec in names}
    else:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a directory")
        from miles.data.digit_preferences import write_digit_preference_data

        paths = {f"digits-preference:{k}": v for k, v in write_digit_preference_data(out.expanduser()).items()}
    for spec, path in paths.items():
        typer.echo(f"{spec:<24} {path}")
