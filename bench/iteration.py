"""Time per phase of one RL iteration of `miles train rl --recipe tiny-digits-grpo` (CPU, Ray, one engine,
one trainer rank): generate, reward, train, weight sync, and what is left (driver and Ray overhead).

It runs `--num-rollout N` (default 4) and reports the medians of rollouts 1..N-1 (rollout 0 warms
up), with each phase's share of the step and the overhead ratio step / (generate + reward + train +
sync), whose ideal is 1.0.

    python bench/iteration.py [--rollouts 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

PHASES = ("perf/generate_time", "perf/reward_time", "perf/train_time", "perf/sync_time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=4)
    opts = parser.parse_args()

    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = ["train", "rl", "--recipe", "tiny-digits-grpo", "--num-rollout", str(opts.rollouts)]
        rc = miles([*argv, "--output-dir", str(out)])
        if rc:
            return rc
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "perf/step_time" in r][1:]
    step = statistics.median(r["perf/step_time"] for r in rows)
    print(f"tiny-digits-grpo: {len(rows)} timed rollouts (after a warm-up), medians")
    total = 0.0
    for key in PHASES:
        value = statistics.median(r[key] for r in rows)
        total += value
        print(f"{key:<22} {value:8.3f} s  {100 * value / step:5.1f} %")
    print(f"{'perf/step_time':<22} {step:8.3f} s")
    print(f"overhead ratio step / sum(phases)  {step / total:6.3f}  (ideal 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
