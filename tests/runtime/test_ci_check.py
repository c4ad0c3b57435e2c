"""The `--ci-test` metric check (`miles.runtime.ci_check`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config.resolution import schema_args
from miles.runtime.ci_check import check_metric, ci_check, last_value, metrics_mark

ROWS = [
    {"rollout_id": 0, "train/loss": 0.9, "eval/d/accuracy": 0.2},
    {"rollout_id": 1, "train/loss": 0.7},
    {"rollout_id": 2, "train/loss": "nan", "eval/d/accuracy": 0.5},
]


def _args(key: str | None = "eval/d/accuracy", threshold: float | None = 0.5, ci_test: bool = True):
    return schema_args(ci_test=ci_test, ci_metric_checker_key=key, ci_metric_checker_threshold=threshold)


def _write(out: Path, rows: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_the_last_logged_value_is_compared_with_greater_or_equal() -> None:
    assert last_value(ROWS, "eval/d/accuracy") == (2, 0.5)
    assert last_value(ROWS, "missing") is None
    assert check_metric(ROWS, "eval/d/accuracy", 0.5) is None  # equal holds
    assert check_metric(ROWS, "eval/d/accuracy", 0.1) is None
    message = check_metric(ROWS, "eval/d/accuracy", 0.6)
    assert message == "eval/d/accuracy = 0.5 (last logged, rollout 2) is below --ci-metric-checker-threshold 0.6"
    # an earlier, higher value does not count: only the last one
    assert check_metric([*ROWS, {"rollout_id": 3, "eval/d/accuracy": 0.1}], "eval/d/accuracy", 0.2) is not None


def test_a_non_finite_or_never_logged_metric_fails() -> None:
    assert "train/loss = nan (last logged, rollout 2)" in check_metric(ROWS, "train/loss", -1e9)
    message = check_metric(ROWS, "train/kl", 0.0)
    assert message == "--ci-metric-checker-key train/kl was never logged (logged keys: eval/d/accuracy, train/loss)"
    assert (
        check_metric([], "train/kl", 0.0) == "--ci-metric-checker-key train/kl was never logged (nothing was logged)"
    )


def test_ci_check_is_the_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _write(tmp_path / "run", ROWS)
    assert ci_check(_args(ci_test=False, key=None, threshold=None), out) == 0  # off: nothing read
    assert ci_check(_args(threshold=0.5), out) == 0
    assert capsys.readouterr().out.strip() == "miles: CI check passed: eval/d/accuracy = 0.5 >= 0.5"
    assert ci_check(_args(threshold=0.75), out) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "miles: CI check failed: eval/d/accuracy = 0.5 (last logged, rollout 2) is below "
        "--ci-metric-checker-threshold 0.75"
    )
    assert "\n" not in err
    assert ci_check(_args(), tmp_path / "no-metrics") == 1  # no metrics.jsonl at all
    assert "never logged (nothing was logged)" in capsys.readouterr().err


def test_only_the_rows_this_job_logged_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A reused output dir: an earlier run's passing value must not pass this run's check."""
    out = _write(tmp_path / "run", ROWS)  # an earlier run logged accuracy 0.5
    start = metrics_mark(out)
    assert start == (out / "metrics.jsonl").stat().st_size and metrics_mark(tmp_path / "none") == 0
    assert ci_check(_args(threshold=0.5), out, start) == 1  # this job logged nothing yet
    assert "never logged (nothing was logged)" in capsys.readouterr().err
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"rollout_id": 0, "train/loss": 0.3}) + "\n")
    assert ci_check(_args(threshold=0.5), out, start) == 1
    assert "never logged (logged keys: train/loss)" in capsys.readouterr().err
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"rollout_id": 1, "eval/d/accuracy": 0.25}) + "\n")
    assert ci_check(_args(threshold=0.2), out, start) == 0
    assert ci_check(_args(threshold=0.5), out) == 1  # all rows: the last one (0.25) is below
