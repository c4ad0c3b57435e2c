"""`metrics.jsonl`: one JSON object per rollout, with its `rollout_id` (append-only, flushed each line; a row that
cannot be written whole, e.g. on a full disk, is taken back and raises `DiskFull`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from miles.utils.disk import writing


class MetricsWriter:
    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"rollout_id": rollout_id, **{k: _plain(v) for k, v in metrics.items()}}
        with writing(self.path):
            _append_whole(self.path, (json.dumps(row) + "\n").encode())
        return row


def _append_whole(path: Path, data: bytes) -> None:
    """Append `data` or nothing: a write cut short (no space left) is truncated back off, so the rows before it
    stay whole (truncating needs no space)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


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
