"""The miles dashboard (`--use-miles-dashboard`): per-run telemetry of the loop's phases, written as it happens.

Each run gets a folder `<--miles-dashboard-workspace>/<job>-<YYYYmmdd-HHMMSS>/` with

    run.json     job, recipe, output dir, a few args, start (and end, once the run closes)
    trace.json   Chrome trace / Perfetto "JSON Array Format": one complete event (`"ph": "X"`, `ts` and `dur`
                 in microseconds since the epoch) per line, plus `"ph": "M"` events naming the tracks

Trace format: the file is a valid JSON array after every flush. It starts as `[` / `]`; each write seeks
back over the closing `]` and writes `,` + the new events + `]` again in one write, so `json.load`,
https://ui.perfetto.dev and chrome://tracing all read it while the run is still going, and a run killed
between writes leaves a complete file. Every event sits on a line of its own, so `read_trace` can also
salvage a file whose last write was torn (a full disk, a power cut).

Tracks (one `tid` each under one process): `loop` (the driver's phases: rollout, train, sync, eval, offload,
onload, save; category `phase`), `rollout manager` (the manager's own generate and reward times from the
batch metrics; category `rollout`) and `request k` (the k-th microgroup request of a rollout, category
`request`; see `DashboardWriter.rollout`). Spans opened inside another inherit its `rollout_id`.

`miles dashboard DIR` summarises a workspace or run folder in the terminal (`miles_cli/dashboard_cmd.py`).
Nothing here imports torch or Ray.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE = "trace.json"
RUN = "run.json"
_TAIL = b"\n]\n"
PID = 1
LOOP = "loop"
MANAGER = "rollout manager"
# args copied into run.json when the job has them
SUMMARY_KEYS = (
    "hf_checkpoint",
    "prompt_data",
    "num_rollout",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "global_batch_size",
    "rollout_microgroup_size",
    "diffusion_num_steps",
    "loss_type",
    "colocate",
    "offload_train",
    "offload_rollout",
    "seed",
)


@dataclass
class Span:
    """An open span: `start` (epoch seconds) is set on entry, `end` on exit; add to `args` inside the block."""

    name: str
    cat: str
    track: str
    args: dict[str, Any] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start


class NullDashboard:
    """The dashboard when --use-miles-dashboard is off: the same calls, nothing written."""

    enabled = False
    run_dir: Path | None = None

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "phase", track: str = LOOP, **args: Any) -> Iterator[Span]:
        span = Span(name, cat, track, dict(args), start=time.time())
        try:
            yield span
        finally:
            span.end = time.time()

    def add(self, name: str, cat: str, start: float, end: float, track: str = LOOP, **args: Any) -> None:
        return None

    def rollout(self, rollout_id: int, start: float, metrics: Mapping[str, Any], samples: Iterable[Any]) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self, **status: Any) -> None:
        return None

    def __enter__(self) -> NullDashboard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DashboardWriter(NullDashboard):
    """Writes `<workspace>/<run>/trace.json` and `run.json` as the run goes (see the module docstring).

    `span(name, cat, **args)` times a block in the driver; `add(name, cat, start, end, track, **args)` records a
    span timed elsewhere (epoch seconds, e.g. `time.time()` inside a Ray actor)."""

    enabled = True

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        job: str,
        *,
        recipe: str | None = None,
        run_name: str | None = None,
        summary: Mapping[str, Any] | None = None,
        microgroup_size: int = 1,
    ) -> None:
        self.microgroup_size = max(1, int(microgroup_size))
        self.workspace = Path(workspace).expanduser()
        self.job = job
        self.run_dir = _new_run_dir(self.workspace, run_name or f"{job}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.trace_path = self.run_dir / TRACE
        # one clock for the driver's spans: wall time at open plus perf_counter since, so nested spans nest exactly
        self._wall0, self._perf0 = time.time(), time.perf_counter()
        self._lock = threading.Lock()
        self._stack: list[Span] = []
        self._tids: dict[str, int] = {}
        self._file = open(self.trace_path, "w+b")  # noqa: SIM115 (kept open for the run; closed in close())
        self._file.write(b"[" + _TAIL)
        self._file.flush()
        self._end = 1  # offset just after the last event (after "[" while there is none)
        self._count = 0
        self._run = {
            "job": job,
            "recipe": recipe,
            "run": self.run_dir.name,
            "started": self._wall0,
            "pid": os.getpid(),
            "trace": TRACE,
            "args": dict(summary or {}),
        }
        _write_json(self.run_dir / RUN, self._run)
        self._meta("process_name", 0, name=f"miles {job}")
        self.track(LOOP)
        self.track(MANAGER)

    # ---- clock ------------------------------------------------------------------------------
    def now(self) -> float:
        """Epoch seconds on the writer's monotonic clock."""
        return self._wall0 + (time.perf_counter() - self._perf0)

    # ---- tracks -----------------------------------------------------------------------------
    def track(self, name: str) -> int:
        """The tid of a named track (made, and named in the trace, on first use)."""
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            self._meta("thread_name", tid, name=name)
            self._meta("thread_sort_index", tid, sort_index=tid)
        return tid

    def _meta(self, kind: str, tid: int, **args: Any) -> None:
        self._write([{"name": kind, "ph": "M", "pid": PID, "tid": tid, "args": args}])

    # ---- spans ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, name: str, cat: str = "phase", track: str = LOOP, **args: Any) -> Iterator[Span]:
        if "rollout_id" not in args:
            for parent in reversed(self._stack):
                if "rollout_id" in parent.args:
                    args["rollout_id"] = parent.args["rollout_id"]
                    break
        span = Span(name, cat, track, args, start=self.now())
        self._stack.append(span)
        try:
            yield span
        except BaseException as exc:
            span.args.setdefault("error", type(exc).__name__)
            raise
        finally:
            span.end = self.now()
            self._stack.remove(span)
            self.add(span.name, span.cat, span.start, span.end, span.track, **span.args)

    def add(self, name: str, cat: str, start: float, end: float, track: str = LOOP, **args: Any) -> None:
        self._write([self._event(name, cat, start, end, track, args)])

    def add_many(self, spans: Iterable[tuple[str, str, float, float, str, Mapping[str, Any]]]) -> None:
        """Several spans in one write: (name, cat, start, end, track, args) each."""
        self._write([self._event(*span) for span in spans])

    def _event(
        self, name: str, cat: str, start: float, end: float, track: str, args: Mapping[str, Any]
    ) -> dict[str, Any]:
        ts = round(start * 1e6)
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": ts,
            "dur": max(0, round(end * 1e6) - ts),
            "pid": PID,
            "tid": self.track(track),
            "args": {k: _jsonable(v) for k, v in args.items()},
        }

    # ---- what a rollout batch carries -------------------------------------------------------------
    def rollout(self, rollout_id: int, start: float, metrics: Mapping[str, Any], samples: Iterable[Any]) -> None:
        """The inside of a `rollout` phase that began at `start` (epoch seconds), from what the batch carries.

        `generate` and `reward` on the manager's track come from `perf/generate_time` and `perf/reward_time`,
        laid end to end from `start` (the manager starts right after the call; Ray's few milliseconds of
        latency are not known). One `request k` span per microgroup request (`microgroups`), from `start`,
        lasting the sum of its samples' `inference_time_s` (an engine divides the time of a call among the
        samples it made): the samples carry how long a request took but neither when it started nor on which
        engine, so these spans show request durations side by side, not the engines' queueing."""
        gen = float(metrics.get("perf/generate_time", 0.0) or 0.0)
        reward = float(metrics.get("perf/reward_time", 0.0) or 0.0)
        spans: list[tuple[str, str, float, float, str, Mapping[str, Any]]] = []
        if gen or reward:
            spans.append(("generate", "rollout", start, start + gen, MANAGER, {"rollout_id": rollout_id}))
            spans.append(("reward", "rollout", start + gen, start + gen + reward, MANAGER, {"rollout_id": rollout_id}))
        for k, request in enumerate(microgroups(samples, self.microgroup_size)):
            seconds = sum(float(getattr(s, "inference_time_s", 0.0) or 0.0) for s in request)
            args = {
                "rollout_id": rollout_id,
                "group_index": getattr(request[0], "group_index", None),
                "indices": [getattr(s, "index", None) for s in request],
                "samples": len(request),
            }
            spans.append(("request", "request", start, start + seconds, f"request {k}", args))
        self.add_many(spans)

    # ---- file ---------------------------------------------------------------------------------
    def _write(self, events: list[dict[str, Any]]) -> None:
        """Append events over the closing bracket in one write: the file is a JSON array before and after."""
        if not events:
            return
        lines = b",\n".join(json.dumps(e, separators=(",", ":")).encode() for e in events)
        with self._lock:
            if self._file.closed:
                return
            head = b",\n" if self._count else b"\n"
            self._file.seek(self._end)
            self._file.write(head + lines + _TAIL)
            self._file.flush()
            self._end += len(head) + len(lines)
            self._count += len(events)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self, **status: Any) -> None:
        """Close the trace and stamp `run.json` with the end time (and `status`, e.g. exit=0)."""
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            self._file.close()
        self._run.update(ended=time.time(), events=self._count, **status)
        _write_json(self.run_dir / RUN, self._run)


def open_dashboard(args: Any, job: str, recipe: str | None = None) -> NullDashboard:
    """A `DashboardWriter` under --miles-dashboard-workspace when --use-miles-dashboard is on, else a no-op."""
    if not getattr(args, "use_miles_dashboard", False):
        return NullDashboard()
    summary = {k: _jsonable(getattr(args, k)) for k in SUMMARY_KEYS if getattr(args, k, None) is not None}
    if getattr(args, "output_dir", None):
        summary["output_dir"] = str(args.output_dir)
    writer = DashboardWriter(
        getattr(args, "miles_dashboard_workspace", None) or "./miles_dashboard",
        job,
        recipe=recipe,
        summary=summary,
        microgroup_size=int(getattr(args, "rollout_microgroup_size", 1) or 1),
    )
    print(f"miles: dashboard trace in {writer.trace_path} (open it in https://ui.perfetto.dev)", flush=True)
    return writer


def microgroups(samples: Iterable[Any], size: int = 1) -> list[list[Any]]:
    """The engine requests a batch was generated in, as the rollout manager cuts them: consecutive samples
    of one prompt group (`group_index`) in chunks of `--rollout-microgroup-size`."""
    size = max(1, int(size))
    out: list[list[Any]] = []
    for s in samples:
        last = out[-1] if out else None
        if (
            last is not None
            and len(last) < size
            and getattr(last[0], "group_index", None) == getattr(s, "group_index", None)
        ):
            last.append(s)
        else:
            out.append([s])
    return out


# ---- reading ------------------------------------------------------------------------------------
def find_traces(path: str | os.PathLike[str]) -> list[Path]:
    """The run folders under `path`: itself when it holds a trace.json, else its subfolders that do (oldest first)."""
    root = Path(path).expanduser()
    if (root / TRACE).is_file():
        return [root]
    if not root.is_dir():
        return []
    runs = [d for d in root.iterdir() if (d / TRACE).is_file()]
    return sorted(runs, key=lambda d: ((d / TRACE).stat().st_mtime, d.name))


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace file (a run folder or trace.json). A file whose last write was torn is read
    line by line, keeping every whole event."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACE
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for line in text.splitlines():
            line = line.strip().rstrip(",")
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    data.append(json.loads(line))
    if isinstance(data, dict):  # the JSON Object Format, in case a trace was re-saved by a tool
        data = data.get("traceEvents", [])
    return [e for e in data if isinstance(e, dict)]


@dataclass
class PhaseStats:
    cat: str
    name: str
    count: int
    total: float  # seconds
    mean: float
    p50: float  # the median
    max: float
    share: float  # total / the run's wall time


@dataclass
class TraceSummary:
    wall: float  # seconds from the first span's start to the last span's end
    spans: int
    phases: list[PhaseStats]  # the driver's phases (cat "phase"), then the rollout manager's (cat "rollout")
    rollouts: dict[int, dict[str, float]]  # rollout id -> phase name -> seconds (and "step": the iteration span)
    requests: list[dict[str, Any]]  # request spans, slowest first: rollout_id, track, seconds and their args


def summarize(events: Iterable[Mapping[str, Any]]) -> TraceSummary:
    """Per-phase statistics, the per-rollout breakdown and the requests by duration, from trace events."""
    spans = [e for e in events if e.get("ph") == "X"]
    tracks = {
        (e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    if not spans:
        return TraceSummary(0.0, 0, [], {}, [])
    first = min(e["ts"] for e in spans)
    last = max(e["ts"] + e.get("dur", 0) for e in spans)
    wall = (last - first) / 1e6
    by_phase: dict[tuple[str, str], list[float]] = {}
    rollouts: dict[int, dict[str, float]] = {}
    requests: list[dict[str, Any]] = []
    for e in spans:
        cat, name, seconds = e.get("cat", ""), e.get("name", ""), e.get("dur", 0) / 1e6
        args = e.get("args") or {}
        rollout_id = args.get("rollout_id")
        if cat in ("phase", "rollout"):
            by_phase.setdefault((cat, name), []).append(seconds)
            if rollout_id is not None:
                key = name if cat == "phase" else f"{cat}/{name}"
                row = rollouts.setdefault(int(rollout_id), {})
                row[key] = row.get(key, 0.0) + seconds
        elif cat == "iteration" and rollout_id is not None:
            row = rollouts.setdefault(int(rollout_id), {})
            row["step"] = row.get("step", 0.0) + seconds
        elif cat == "request":
            track = tracks.get((e.get("pid"), e.get("tid")), str(e.get("tid")))
            requests.append({"seconds": seconds, "track": track, **args})
    order = {"phase": 0, "rollout": 1}
    phases = [
        PhaseStats(
            cat,
            name,
            len(values),
            sum(values),
            sum(values) / len(values),
            statistics.median(values),
            max(values),
            sum(values) / wall if wall > 0 else 0.0,
        )
        for (cat, name), values in sorted(by_phase.items(), key=lambda kv: (order[kv[0][0]], -sum(kv[1])))
    ]
    requests.sort(key=lambda r: -r["seconds"])
    return TraceSummary(wall, len(spans), phases, dict(sorted(rollouts.items())), requests)


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """A run folder's run.json ({} when missing or unreadable)."""
    with contextlib.suppress(OSError, json.JSONDecodeError):
        data = json.loads((Path(run_dir) / RUN).read_text())
        return data if isinstance(data, dict) else {}
    return {}


def _new_run_dir(workspace: Path, name: str) -> Path:
    workspace.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        candidate = workspace / (name if n == 0 else f"{name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{workspace}: no free run folder name for {name}")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        with contextlib.suppress(Exception):
            return _jsonable(value.item())
    return str(value)
