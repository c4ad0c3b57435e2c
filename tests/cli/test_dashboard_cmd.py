"""`miles dashboard DIR`: the terminal summary of a dashboard trace, in-process."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from miles.io.dashboard import DashboardWriter
from miles_cli.main import main

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, _ANSI.sub("", out), _ANSI.sub("", err)


def synthetic_run(workspace: Path, name: str = "run") -> Path:
    """Two rollouts: rollout 3 s + train 1 s, then rollout 1 s + train 2 s (+ 0.5 s sync); wall 10 s."""
    dash = DashboardWriter(workspace, "rl", recipe="tiny", run_name=name)
    t = 1000.0
    dash.add("rollout", "phase", t + 0, t + 3, rollout_id=0)
    dash.add("generate", "rollout", t + 0, t + 2, "rollout manager", rollout_id=0)
    dash.add("request", "request", t + 0, t + 1.5, "request 0", rollout_id=0, group_index=0, samples=2)
    dash.add("request", "request", t + 0, t + 0.5, "request 1", rollout_id=0, group_index=1, samples=2)
    dash.add("train", "phase", t + 3, t + 4, rollout_id=0)
    dash.add("rollout", "phase", t + 5, t + 6, rollout_id=1)
    dash.add("request", "request", t + 5, t + 5.75, "request 0", rollout_id=1, group_index=2, samples=2)
    dash.add("train", "phase", t + 6, t + 8, rollout_id=1)
    dash.add("sync", "phase", t + 8, t + 8.5, rollout_id=1)
    dash.add("rollout 1", "iteration", t + 5, t + 10, "iterations", rollout_id=1)
    dash.close()
    return dash.run_dir


def table_row(out: str, first: str) -> list[str]:
    """The first line whose first cell is `first`, split in cells."""
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [first])


def test_summary_numbers_of_a_synthetic_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run_dir = synthetic_run(tmp_path)
    code, out, err = run(capsys, "dashboard", str(run_dir))
    assert code == 0, err
    assert f"run {run_dir}" in out and "job rl, recipe tiny; finished" in out
    assert "wall 10.00s over 10 spans" in out
    # phase count total mean p50 max share
    assert table_row(out, "rollout") == ["rollout", "2", "4.000", "2.000", "2.000", "3.000", "40.0%"]
    assert table_row(out, "train") == ["train", "2", "3.000", "1.500", "1.500", "2.000", "30.0%"]
    assert table_row(out, "sync") == ["sync", "1", "0.500", "0.500", "0.500", "0.500", "5.0%"]
    assert table_row(out, "rollout/generate") == ["rollout/generate", "1", "2.000", "2.000", "2.000", "2.000", "20.0%"]
    # per rollout id: rollout train sync rollout/generate step
    assert "rollout/generate" in out.split("seconds per rollout id")[1].splitlines()[1]
    assert table_row(out, "0") == ["0", "3.000", "1.000", "-", "2.000", "-"]
    assert table_row(out, "1") == ["1", "1.000", "2.000", "0.500", "-", "5.000"]
    slow = out.split("slowest requests (of 3)")[1].splitlines()[2:]
    assert [line.split() for line in slow] == [
        ["1.500", "0", "0", "2", "request", "0"],
        ["0.750", "1", "2", "2", "request", "0"],
        ["0.500", "0", "1", "2", "request", "1"],
    ]
    _, out, _ = run(capsys, "dashboard", str(run_dir), "--top", "1", "--rollouts", "1")
    assert len(out.split("slowest requests (of 3)")[1].splitlines()) == 3
    assert "(the last 1 of 2)" in out


def test_a_workspace_summarises_its_newest_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old = synthetic_run(tmp_path, "old")
    os.utime(old / "trace.json", (1, 1))
    new = synthetic_run(tmp_path, "new")
    code, out, _ = run(capsys, "dashboard", str(tmp_path))
    assert code == 0
    assert f"run {new}" in out and f"other runs in {tmp_path}: old" in out


def test_a_running_trace_is_read_too(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "sft", run_name="run")
    dash.add("train", "phase", 5.0, 7.0, rollout_id=0)  # not closed: the run is still going
    code, out, _ = run(capsys, "dashboard", str(dash.run_dir))
    assert code == 0
    assert "running or stopped" in out and table_row(out, "train")[:3] == ["train", "1", "2.000"]
    assert json.loads((dash.run_dir / "trace.json").read_text())  # and the file stays a JSON array
    dash.close()


@pytest.mark.parametrize("make", ["empty", "missing", "no-spans"])
def test_no_trace_is_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, make: str) -> None:
    path = tmp_path / "ws"
    if make == "empty":
        path.mkdir()
    elif make == "no-spans":
        path = DashboardWriter(path, "rl", run_name="run").run_dir
    code, out, err = run(capsys, "dashboard", str(path))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err and err.startswith("miles: error: ")


def test_top_level_help_lists_dashboard(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "--help")
    assert code == 0 and re.search(r"\bdashboard\b", out)
    code, out, _ = run(capsys, "dashboard", "--help")
    assert code == 0 and "--top" in out and "--rollouts" in out
