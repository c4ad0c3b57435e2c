"""`--ci-test`: the CI metric check at the end of a job (used by tests/e2e, not meant for manual runs).

With `--ci-test --ci-metric-checker-key KEY --ci-metric-checker-threshold X` the job's exit code says
whether the last value of KEY this job logged to `<output-dir>/metrics.jsonl` reached the threshold: it passes when
`value >= X` (a metric that must stay low, e.g. a loss, is checked through a metric that grows, or by a
test reading metrics.jsonl itself). A value below X, a non-finite value, or a key that was never logged
prints one line and exits 1. The config rules make the three flags go together. Only the rows the job itself
appended count (`metrics_mark` at its start): a metric left in a reused output dir by an earlier run does not.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

FAILED = 1


def last_value(rows: list[dict[str, Any]], key: str) -> tuple[int, Any] | None:
    """(rollout_id, value) of the last row that logged `key`, or None."""
    for row in reversed(rows):
        if key in row:
            return int(row.get("rollout_id", -1)), row[key]
    return None


def check_metric(rows: list[dict[str, Any]], key: str, threshold: float) -> str | None:
    """None when the last logged `key` is >= `threshold`, else the one-line reason it is not."""
    found = last_value(rows, key)
    if found is None:
        logged = sorted({k for row in rows for k in row} - {"rollout_id"})
        hint = f" (logged keys: {', '.join(logged)})" if logged else " (nothing was logged)"
        return f"--ci-metric-checker-key {key} was never logged{hint}"
    rollout_id, raw = found
    try:
        value = float(raw)  # non-finite values are logged as strings ("nan", "inf")
    except (TypeError, ValueError):
        return f"--ci-metric-checker-key {key}: the last logged value {raw!r} (rollout {rollout_id}) is not a number"
    if not math.isfinite(value) or value < threshold:
        return (
            f"{key} = {value:.6g} (last logged, rollout {rollout_id}) is below "
            f"--ci-metric-checker-threshold {threshold:g}"
        )
    return None


def metrics_mark(out: str | Path) -> int:
    """The size of `<out>/metrics.jsonl` now (0 when absent): where the rows of a job starting now begin."""
    path = Path(out) / "metrics.jsonl"
    return path.stat().st_size if path.is_file() else 0


def rows_since(path: Path, start: int) -> list[dict[str, Any]]:
    """The metric rows written to `path` after byte `start`."""
    import json

    if not path.is_file():
        return []
    with path.open("rb") as f:
        f.seek(start)
        text = f.read().decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ci_check(args: Any, out: str | Path, since: int = 0) -> int:
    """The job's exit code: 0 without --ci-test or when the check holds, else 1 (with one line on stderr).
    `since`: the `metrics_mark` taken when the job started (rows before it belong to earlier runs)."""
    if not args.ci_test:
        return 0
    key, threshold = args.ci_metric_checker_key, float(args.ci_metric_checker_threshold)
    rows = rows_since(Path(out) / "metrics.jsonl", since)
    failure = check_metric(rows, key, threshold)
    if failure is not None:
        print(f"miles: CI check failed: {failure}", file=sys.stderr, flush=True)
        return FAILED
    value = last_value(rows, key)[1]  # type: ignore[index]
    print(f"miles: CI check passed: {key} = {float(value):.6g} >= {threshold:g}", flush=True)
    return 0
