"""The dashboard writer (`miles.io.dashboard`): a trace valid after every write, spans that nest, the null writer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.io.dashboard import (
    DashboardWriter,
    NullDashboard,
    find_traces,
    microgroups,
    open_dashboard,
    read_trace,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]


def spans(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text()) if e["ph"] == "X"]


def track_names(path: Path) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in json.loads(path.read_text()) if e.get("name") == "thread_name"}


def test_the_trace_is_a_json_array_after_every_write(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    trace = tmp_path / "run" / "trace.json"
    assert [e["ph"] for e in json.loads(trace.read_text())] == ["M"] * 5  # process name + two named tracks
    for i in range(3):
        with dash.span("train", rollout_id=i):
            assert len(spans(trace)) == i  # still valid while a span is open
        assert len(spans(trace)) == i + 1
        assert trace.read_text().endswith("\n]\n")
    dash.close()
    assert [e["args"]["rollout_id"] for e in spans(trace)] == [0, 1, 2]
    lines = trace.read_text().splitlines()
    assert lines[0] == "[" and lines[-1] == "]"
    assert all(line.rstrip(",").startswith("{") for line in lines[1:-1])  # one event per line


def test_events_are_complete_chrome_trace_events(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    dash.add("request", "request", 100.0, 100.25, "request 0", rollout_id=3, group_index=7)
    dash.close()
    (event,) = spans(tmp_path / "run" / "trace.json")
    assert set(event) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
    assert (event["ts"], event["dur"]) == (100_000_000, 250_000)
    assert event["args"] == {"rollout_id": 3, "group_index": 7}
    assert track_names(tmp_path / "run" / "trace.json")[event["tid"]] == "request 0"


def test_a_killed_run_leaves_a_loadable_trace(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from miles.io.dashboard import DashboardWriter\n"
        "dash = DashboardWriter(sys.argv[1], 'rl', run_name='run')\n"
        "with dash.span('rollout', rollout_id=0):\n"
        "    pass\n"
        "dash.add('train', 'phase', 1.0, 2.0, rollout_id=0)\n"
        "os._exit(9)  # no close, no flush at exit\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=60)
    assert result.returncode == 9, result.stderr
    assert [e["name"] for e in spans(tmp_path / "run" / "trace.json")] == ["rollout", "train"]
    assert "ended" not in json.loads((tmp_path / "run" / "run.json").read_text())


def test_a_torn_last_write_is_salvaged_line_by_line(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    for i in range(3):
        dash.add("train", "phase", i, i + 0.5, rollout_id=i)
    dash.close()
    trace = tmp_path / "run" / "trace.json"
    text = trace.read_text()
    trace.write_text(text[: text.rindex('"args"') + 4])  # cut inside the last event
    with pytest.raises(json.JSONDecodeError):
        json.loads(trace.read_text())
    assert [e["args"]["rollout_id"] for e in read_trace(trace) if e["ph"] == "X"] == [0, 1]


def test_spans_nest_and_inherit_the_rollout_id(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    with dash.span("rollout 4", "iteration", track="iterations", rollout_id=4) as outer:
        with dash.span("train") as inner:
            time.sleep(0.01)
        with dash.span("sync", rollout_id=9):
            pass
    dash.close()
    assert inner.seconds >= 0.01 and outer.start <= inner.start < inner.end <= outer.end
    by_name = {e["name"]: e for e in spans(tmp_path / "run" / "trace.json")}
    train, it = by_name["train"], by_name["rollout 4"]
    assert it["ts"] <= train["ts"] and train["ts"] + train["dur"] <= it["ts"] + it["dur"]
    assert train["dur"] >= 10_000
    assert train["args"] == {"rollout_id": 4}
    assert by_name["sync"]["args"] == {"rollout_id": 9}  # an explicit id wins
    names = track_names(tmp_path / "run" / "trace.json")
    assert names[train["tid"]] == "loop" and names[it["tid"]] == "iterations"


def test_a_failing_span_is_recorded_with_its_error(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    with pytest.raises(RuntimeError), dash.span("train", rollout_id=0):
        raise RuntimeError("boom")
    dash.close()
    (event,) = spans(tmp_path / "run" / "trace.json")
    assert event["args"] == {"rollout_id": 0, "error": "RuntimeError"}


def sample(index: int, group: int, seconds: float) -> SimpleNamespace:
    return SimpleNamespace(index=index, group_index=group, inference_time_s=seconds)


def test_microgroups_cut_groups_like_the_manager() -> None:
    samples = [sample(i, i // 3, 1.0) for i in range(6)]  # two groups of 3
    assert [[s.index for s in m] for m in microgroups(samples, 2)] == [[0, 1], [2], [3, 4], [5]]
    assert len(microgroups(samples, 1)) == 6


def test_rollout_spans_from_the_batch(tmp_path: Path) -> None:
    dash = DashboardWriter(tmp_path, "rl", run_name="run", microgroup_size=2)
    samples = [sample(0, 5, 0.5), sample(1, 5, 0.5), sample(2, 6, 0.25), sample(3, 6, 0.25)]
    dash.rollout(7, 10.0, {"perf/generate_time": 2.0, "perf/reward_time": 0.5}, samples)
    dash.close()
    events = spans(tmp_path / "run" / "trace.json")
    manager = [(e["name"], e["ts"], e["dur"]) for e in events if e["cat"] == "rollout"]
    assert manager == [("generate", 10_000_000, 2_000_000), ("reward", 12_000_000, 500_000)]
    requests = [e for e in events if e["cat"] == "request"]
    assert [(e["ts"], e["dur"], e["args"]["group_index"], e["args"]["indices"]) for e in requests] == [
        (10_000_000, 1_000_000, 5, [0, 1]),
        (10_000_000, 500_000, 6, [2, 3]),
    ]
    names = track_names(tmp_path / "run" / "trace.json")
    assert [names[e["tid"]] for e in requests] == ["request 0", "request 1"]


def test_run_json_and_a_fresh_folder_per_run(tmp_path: Path) -> None:
    first = DashboardWriter(tmp_path, "rl", recipe="tiny", run_name="run", summary={"num_rollout": 2})
    second = DashboardWriter(tmp_path, "rl", run_name="run")
    assert (first.run_dir.name, second.run_dir.name) == ("run", "run-1")
    info = json.loads((first.run_dir / "run.json").read_text())
    assert (info["job"], info["recipe"], info["args"]) == ("rl", "tiny", {"num_rollout": 2})
    assert info["trace"] == "trace.json"
    first.close(exit=0)
    info = json.loads((first.run_dir / "run.json").read_text())
    assert info["exit"] == 0 and info["ended"] >= info["started"] and info["events"] == 5
    first.add("late", "phase", 0.0, 1.0)  # after close: ignored, the file stays valid
    assert spans(first.trace_path) == []
    second.close()
    assert find_traces(tmp_path) == [first.run_dir, second.run_dir]
    assert find_traces(first.run_dir) == [first.run_dir]


def test_the_null_writer_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    dash = NullDashboard()
    with dash.span("train", rollout_id=0) as span:
        pass
    assert span.end >= span.start
    dash.add("x", "phase", 0.0, 1.0)
    dash.rollout(0, 0.0, {"perf/generate_time": 1.0}, [sample(0, 0, 1.0)])
    dash.close()
    assert list(tmp_path.iterdir()) == []


def test_the_flag_off_writes_no_workspace(tmp_path: Path) -> None:
    workspace = tmp_path / "dash"
    off = SimpleNamespace(use_miles_dashboard=False, miles_dashboard_workspace=str(workspace))
    assert type(open_dashboard(off, "rl")) is NullDashboard
    assert not workspace.exists()
    on = SimpleNamespace(
        use_miles_dashboard=True, miles_dashboard_workspace=str(workspace), rollout_microgroup_size=4, num_rollout=3
    )
    with open_dashboard(on, "rl", "tiny") as dash:
        assert isinstance(dash, DashboardWriter) and dash.microgroup_size == 4
    (run,) = find_traces(workspace)
    assert run.name.startswith("rl-")
    assert json.loads((run / "run.json").read_text())["args"] == {"num_rollout": 3, "rollout_microgroup_size": 4}


def test_phase_switches_are_offload_and_onload_spans(tmp_path: Path) -> None:
    from miles.runtime.phases import Phases

    class Group:
        def offload(self, parts: tuple[str, ...]) -> int:
            return 100 * len(parts)

        def onload(self) -> None:
            pass

    dash = DashboardWriter(tmp_path, "rl", run_name="run")
    phases = Phases(SimpleNamespace(offload_train=True, offload_rollout=False), None, [Group()], dash=dash)
    with dash.span("rollout 0", "iteration", track="iterations", rollout_id=0):
        phases.to_train()
        phases.to_sync()
    dash.close()
    moves = [(e["name"], e["args"]) for e in spans(tmp_path / "run" / "trace.json") if e["cat"] == "phase"]
    assert moves == [
        ("onload", {"what": "trainers", "rollout_id": 0}),
        ("offload", {"what": "trainers", "parts": ["optimizer", "grads", "frozen"], "rollout_id": 0, "bytes": 300}),
    ]


def test_summarize_a_synthetic_trace() -> None:
    def x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
        return {"name": name, "cat": cat, "ph": "X", "ts": ts * 1e6, "dur": dur * 1e6, "pid": 1, "tid": tid} | {
            "args": args
        }

    events = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 9, "args": {"name": "request 0"}},
        x("rollout", "phase", 0, 4, rollout_id=0),
        x("generate", "rollout", 0, 3, tid=2, rollout_id=0),
        x("request", "request", 0, 2.5, tid=9, rollout_id=0, group_index=0),
        x("train", "phase", 4, 2, rollout_id=0),
        x("rollout", "phase", 6, 2, rollout_id=1),
        x("train", "phase", 8, 1, rollout_id=1),
        x("train", "phase", 9, 1, rollout_id=1),
        x("rollout 1", "iteration", 6, 4, tid=3, rollout_id=1),
    ]
    summary = summarize(events)
    assert summary.wall == 10 and summary.spans == 8
    rows = {(p.cat, p.name): (p.count, p.total, p.mean, p.p50, p.max, p.share) for p in summary.phases}
    assert rows == {
        ("phase", "rollout"): (2, 6.0, 3.0, 3.0, 4.0, 0.6),
        ("phase", "train"): (3, 4.0, 4 / 3, 1.0, 2.0, 0.4),
        ("rollout", "generate"): (1, 3.0, 3.0, 3.0, 3.0, 0.3),
    }
    assert [p.name for p in summary.phases] == ["rollout", "train", "generate"]
    assert summary.rollouts == {
        0: {"rollout": 4.0, "rollout/generate": 3.0, "train": 2.0},
        1: {"rollout": 2.0, "train": 2.0, "step": 4.0},
    }
    assert summary.requests == [{"seconds": 2.5, "track": "request 0", "rollout_id": 0, "group_index": 0}]
