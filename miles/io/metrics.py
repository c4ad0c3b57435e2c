"""`metrics.jsonl`: one JSON object per rollout, with its `rollout_id` (append-only, flushed each line)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"rollout_id": rollout_id, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        return row


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def summary_line(rollout_id: int, metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = [f"rollout {rollout_id}"]
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return "  ".join(parts)
