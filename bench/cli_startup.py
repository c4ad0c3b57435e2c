"""CLI start-up time: `miles --help` and `miles inspect-config --recipe sd35-4step` against `python -c pass`.

The baseline is the bare interpreter start measured in the same run; the goal is under 0.5 s for
--help and under 1.0 s for inspect-config (wall time, median of N runs).

    python bench/cli_startup.py [--runs 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "miles --help": [sys.executable, "-m", "miles_cli", "--help"],
    "miles inspect-config --recipe sd35-4step": [
        sys.executable,
        "-m",
        "miles_cli",
        "inspect-config",
        "--recipe",
        "sd35-4step",
    ],
}
GOALS = {"miles --help": 0.5, "miles inspect-config --recipe sd35-4step": 1.0}


def wall_times(cmd: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    opts = parser.parse_args()
    for cmd in CASES.values():  # warm the file cache
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    medians = {name: statistics.median(wall_times(cmd, opts.runs)) for name, cmd in CASES.items()}
    base = medians["python -c pass"]
    print(f"{'command':<44} {'median s':>9} {'x python':>9} {'goal s':>7}")
    failed = False
    for name, median in medians.items():
        goal = GOALS.get(name)
        ok = goal is None or median < goal
        failed |= not ok
        goal_text = f"{goal:.1f}" if goal else "-"
        print(f"{name:<44} {median:>9.3f} {median / base:>9.2f} {goal_text:>7}{'' if ok else '  OVER GOAL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
