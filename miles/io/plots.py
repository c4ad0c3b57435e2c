"""Training curves from `metrics.jsonl` as one PNG (matplotlib, Agg; no pyplot global state)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.utils.atomic import atomic_open

DEFAULT_KEYS = ("rollout/reward/raw_mean", "train/loss", "train/kl_loss")
PANEL_SIZE = (5.0, 3.5)  # inches per panel (width, height)
DPI = 100
SMOOTH_MIN_POINTS = 11  # a moving average is drawn from this many points on


def read_series(metrics_jsonl: str | os.PathLike, keys: Sequence[str]) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (rollout_ids, values)} for the keys with at least one finite value, in `keys` order.

    Unreadable lines and non-numeric or non-finite values ("nan" written as text) are skipped.
    """
    path = Path(metrics_jsonl)
    if not path.is_file():
        return {}
    series: dict[str, tuple[list[int], list[float]]] = {key: ([], []) for key in keys}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if not isinstance(row, dict) or "rollout_id" not in row:
            continue
        for key in keys:
            value = _number(row.get(key))
            if value is not None:
                series[key][0].append(int(row["rollout_id"]))
                series[key][1].append(value)
    return {key: points for key, points in series.items() if points[0]}


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(
    metrics_jsonl: str | os.PathLike,
    out_png: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_KEYS,
    title: str | None = None,
) -> Path | None:
    """One panel per key present in the file (value vs rollout_id), side by side.

    Returns the PNG path, or None (and writes nothing) when none of `keys` has a value.
    """
    series = read_series(metrics_jsonl, keys)
    if not series:
        return None

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(series)
    fig = Figure(figsize=(PANEL_SIZE[0] * n, PANEL_SIZE[1]), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (key, (steps, values)) in zip(axes, series.items(), strict=True):
        smooth = len(values) >= SMOOTH_MIN_POINTS
        ax.plot(steps, values, marker="." if len(values) < 50 else None, alpha=0.35 if smooth else 1.0, label=key)
        if smooth:
            window = max(3, len(values) // 10)
            ax.plot(steps, moving_average(values, window), linewidth=2, label=f"moving avg ({window})")
            ax.legend(fontsize="small")
        ax.set_title(key)
        ax.set_xlabel("rollout_id")
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    with atomic_open(out_png, "wb") as handle:
        fig.savefig(handle, format="png", dpi=DPI)
    return Path(out_png)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
