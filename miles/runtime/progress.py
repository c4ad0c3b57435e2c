"""A rich progress bar for the loop over rollouts, with the latest metrics line under it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(what: str, total: int) -> Iterator[Callable[[str], None]]:
    """Yields `advance(line)`: one step done, `line` printed above the bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(what, total=total)

        def advance(line: str = "") -> None:
            if line:
                progress.console.print(line) if sys.stderr.isatty() else print(line, flush=True)
            progress.advance(task)

        yield advance
