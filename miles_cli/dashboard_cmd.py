"""`miles dashboard DIR`: a terminal summary of a run's dashboard trace (`--use-miles-dashboard`).

DIR is a run folder (it holds trace.json) or a workspace (the newest run under it is summarised; the others
are listed). Torch- and Ray-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miles.core.errors import ConfigError


def dashboard(
    path: Annotated[
        Path,
        typer.Argument(metavar="DIR", help="A dashboard workspace (--miles-dashboard-workspace) or one run folder."),
    ],
    top: Annotated[int, typer.Option("--top", help="How many of the slowest requests to list.")] = 10,
    rollouts: Annotated[
        int, typer.Option("--rollouts", help="How many rollout ids (the last ones) to break down; 0 for all.")
    ] = 20,
) -> None:
    """Summarise a run's phase telemetry: per phase count / total / mean / p50 / max seconds and share of
    wall time, the phases of each rollout id, and the slowest engine requests."""
    from miles.io.dashboard import find_traces, read_run, read_trace, summarize

    runs = find_traces(path)
    if not runs:
        raise ConfigError(f"{path}: no dashboard trace here (no trace.json in it or in a folder under it)")
    run_dir = runs[-1]
    summary = summarize(read_trace(run_dir))
    if not summary.spans:
        raise ConfigError(f"{run_dir / 'trace.json'}: the trace holds no spans yet")
    info = read_run(run_dir)
    echo = typer.echo
    state = "finished" if "ended" in info else "running or stopped without closing"
    recipe = f", recipe {str(info['recipe']).removeprefix('recipe ')}" if info.get("recipe") else ""
    echo(f"run {run_dir}  (job {info.get('job', '?')}{recipe}; {state})")
    echo(f"wall {summary.wall:.2f}s over {summary.spans} spans")
    if len(runs) > 1:
        others = ", ".join(r.name for r in runs[:-1])
        echo(f"other runs in {path}: {others} (pass a run folder to see one)")

    echo("")
    echo(f"{'phase':<20} {'count':>6} {'total s':>10} {'mean s':>9} {'p50 s':>9} {'max s':>9} {'share':>7}")
    for p in summary.phases:
        name = p.name if p.cat == "phase" else f"  {p.cat}/{p.name}"
        echo(f"{name:<20} {p.count:>6} {p.total:>10.3f} {p.mean:>9.3f} {p.p50:>9.3f} {p.max:>9.3f} {p.share:>6.1%}")

    if summary.rollouts:
        ids = list(summary.rollouts)
        shown = ids if rollouts <= 0 else ids[-rollouts:]
        columns = [p.name if p.cat == "phase" else f"{p.cat}/{p.name}" for p in summary.phases]
        columns = [c for c in columns if any(c in summary.rollouts[i] for i in shown)]
        if any("step" in summary.rollouts[i] for i in shown):
            columns.append("step")
        echo("")
        echo("seconds per rollout id" + (f" (the last {len(shown)} of {len(ids)})" if len(shown) < len(ids) else ""))
        widths = [max(9, len(c) + 1) for c in columns]
        echo(f"{'rollout':>8}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
        for i in shown:
            row = summary.rollouts[i]
            cells = (f"{row[c]:>{w}.3f}" if c in row else f"{'-':>{w}}" for c, w in zip(columns, widths, strict=True))
            echo(f"{i:>8}" + "".join(cells))

    if summary.requests and top > 0:
        echo("")
        echo(f"slowest requests (of {len(summary.requests)})")
        echo(f"{'seconds':>9} {'rollout':>8} {'group':>6} {'samples':>8}  track")
        for r in summary.requests[:top]:
            echo(
                f"{r['seconds']:>9.3f} {_cell(r.get('rollout_id')):>8} {_cell(r.get('group_index')):>6} "
                f"{_cell(r.get('samples')):>8}  {r.get('track', '')}"
            )


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
