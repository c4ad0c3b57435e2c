"""Preflight cost: the checks a job runs before Ray starts, for every shipped recipe and a 1 M-line prompt file.

Per recipe: the preflight of the resolved job, in a fresh interpreter (`cold`: the preflight's own imports
included, resolution not) and warm in this process (median of N). For the prompt file (1,000,000 digit prompt
lines, generated in a temp dir): the whole `--prompt-data` check (streamed parse, prompt and metadata checks,
the digit reward's label) against the plain-library baseline measured in the same run, `json.loads` of every
line of the same file. Goal: under 2 s for every CPU recipe, cold; no recipe imports torch or Ray.

    python bench/bench_preflight.py [--repeats 5] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_timing import interleaved_medians

GOAL_S = 2.0
ROOT = Path(__file__).resolve().parents[1]
_COLD = """
import sys, time
from miles.config.resolve import resolve
resolved = resolve(None, recipe=sys.argv[1])
start = time.perf_counter()
from miles.preflight import run_checks
report = run_checks(resolved)
seconds = time.perf_counter() - start
heavy = ",".join(m for m in ("torch", "ray") if m in sys.modules) or "-"
print(f"{seconds:.4f} {report.checks} {len(report.problems)} {heavy}")
"""


def cold(recipe: str, env: dict[str, str]) -> tuple[float, int, int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _COLD, recipe], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    ).stdout.split()
    return float(out[0]), int(out[1]), int(out[2]), out[3]


def recipe_table(repeats: int, env: dict[str, str]) -> bool:
    from miles.config.recipes import shipped_recipes
    from miles.config.resolve import resolve
    from miles.preflight import run_checks

    print(f"{'recipe':<30} {'job':<13} {'checks':>6} {'problems':>8} {'cold s':>7} {'warm ms':>8} {'heavy':>6}  goal")
    ok = True
    for name, path in shipped_recipes().items():
        cpu = "description: CPU" in path.read_text(encoding="utf-8")
        resolved = resolve(None, recipe=name)
        seconds, checks, problems, heavy = cold(name, env)
        warm = interleaved_medians({name: lambda r=resolved: run_checks(r)}, repeats)[name]
        passed = not cpu or (seconds < GOAL_S and heavy == "-")
        ok &= passed
        goal = (f"< {GOAL_S:.0f} s" + ("" if passed else "  OVER GOAL")) if cpu else "-"
        print(
            f"{name:<30} {resolved.spec.name:<13} {checks:>6} {problems:>8} {seconds:>7.3f} {warm * 1e3:>8.2f} "
            f"{heavy:>6}  {goal}"
        )
    return ok


def prompt_file_row(lines: int, env_home: str) -> None:
    from miles.config.resolve import resolve
    from miles.preflight.data import check_prompt_data

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            for i in range(lines):
                handle.write(json.dumps({"input": f"the digit {i % 10}", "metadata": {"label": i % 10}}) + "\n")
        size_mib = path.stat().st_size / 2**20
        resolved = resolve("rl", recipe="tiny-digits-grpo", cli={"prompt_data": str(path), "output_dir": tmp})

        def baseline() -> None:
            with path.open("rb") as handle:
                for raw in handle:
                    json.loads(raw)

        def preflight() -> None:
            assert check_prompt_data(resolved) == []

        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        medians = interleaved_medians({"json.loads": baseline, "preflight": preflight}, repeats=3)
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ratio = medians["preflight"] / medians["json.loads"]
    print(
        f"\n--prompt-data of {lines:,} lines ({size_mib:.0f} MiB): preflight {medians['preflight']:.2f} s, "
        f"json.loads of every line {medians['json.loads']:.2f} s (same run), ratio {ratio:.2f}x; "
        f"peak RSS {rss_before:.0f} -> {rss_after:.0f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lines", type=int, default=1_000_000)
    opts = parser.parse_args()
    home = tempfile.mkdtemp(prefix="miles-bench-home-")
    os.environ["MILES_HOME"] = home  # built-in names pass without building; nothing is written there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    ok = recipe_table(opts.repeats, env)
    prompt_file_row(opts.lines, home)
    print(f"\n({time.perf_counter() - start:.0f} s in all; cold = a fresh interpreter's preflight with its imports)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
