"""`miles models ...`: build and inspect the embedded checkpoints. Torch-free at import."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from miles.core.errors import ConfigError

app = typer.Typer(
    help="Build the embedded models (tiny-sd3, tiny-flux, tiny-qwen-image, tiny-wan2_2, tiny-cosmos3, tiny-ltx2) "
    "offline.",
    no_args_is_help=True,
)


@app.callback()
def _models() -> None:
    """Build the embedded models offline."""


@app.command("build")
def build(
    name: Annotated[
        str,
        typer.Argument(
            help="Model to build: tiny-sd3, tiny-flux, tiny-qwen-image, tiny-wan2_2, tiny-cosmos3, tiny-ltx2."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to build into (default: $MILES_HOME/models/NAME)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of every initialisation and of the VAE fit.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if the checkpoint exists.")] = False,
) -> None:
    """Build NAME offline and deterministically; print the build time and the classifier accuracy."""
    from miles.builtin.checkpoints import BUILTIN_MODELS, builtin_checkpoint_dir, is_complete
    from miles.models.tiny.metadata import read_metadata

    if name not in BUILTIN_MODELS:
        raise ConfigError(f"models build: unknown model {name!r}; buildable models: {', '.join(BUILTIN_MODELS)}")
    target = out.expanduser() if out is not None else builtin_checkpoint_dir(name)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        complete = is_complete(target)
        where = f"--out {target}" if out is not None else f"{target} (the default location)"
        if not force:
            meta = read_metadata(target) if complete else None
            if meta is not None and out is None and is_complete(target, name):
                typer.echo(
                    f"{name} is already built at {target} (seed {meta['seed']}, classifier test accuracy "
                    f"{meta['digit_classifier']['test_accuracy']:.4f}); pass --force to rebuild"
                )
                return
            if meta is not None and out is None:  # our own cache, made by an older builder
                typer.echo(f"{target} holds a build of an older {name} design; rebuilding it")
            else:
                state = f"already holds a {name} checkpoint" if complete else "exists and is not empty"
                raise ConfigError(f"{where}: {state}; pass --force to replace it")
        if out is not None and not complete:
            raise ConfigError(f"{where}: --force only replaces a {name} checkpoint, and this is not one")
        shutil.rmtree(target)
    from miles.builtin.checkpoints import TINY_BUILDERS, tiny_builder
    from miles.utils.paths import file_lock

    if name not in TINY_BUILDERS:
        raise ConfigError(
            f"models build: {name!r} is built by training (on first use by its recipes); "
            f"offline builds: {', '.join(TINY_BUILDERS)}"
        )
    build_fn = tiny_builder(name)
    if out is None:  # the shared location: serialize with ensure_checkpoint's builds
        with file_lock(target.parent / f".{name}.lock"):
            report = build_fn(target, seed=seed, progress=True)
    else:
        report = build_fn(target, seed=seed, progress=True)
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.phase_seconds.items())
    typer.echo(f"built {name} at {report.out_dir} in {report.seconds:.1f}s ({phases})")
    typer.echo(f"digit classifier test accuracy: {report.classifier_test_accuracy:.4f}")
    typer.echo(
        f"vae test mse: {report.vae_test_mse:.5f}; classifier accuracy on vae reconstructions: "
        f"{report.vae_recon_accuracy:.4f}"
    )
