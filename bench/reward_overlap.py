"""Scoring overlaps generation: a reward that takes 50 ms an image, scored while the engine generates the rest.

`miles rollout-only --recipe tiny-digits-grpo` (60 prompts x 16 samples, microgroups of 16) with the digit reward
made slow (`slow_digit`: the digit classifier, then 50 ms of waiting per image on one of 4 workers, as a reward
model on other GPUs or a service would take), two ways in the same run:

- `streamed`: each microgroup is scored as soon as it is generated (the default);
- `after`: `--group-rm`, every group scored once the whole rollout is generated (the old path, the baseline).

It prints, per engine, the median over the rollouts of `perf/generate_time` and `perf/rollout_time` and their
ratio (the goal: rollout within 5 % of generation when streamed), and the baseline's rollout time against the
streamed one's.

    python bench/reward_overlap.py [--rollouts 3] [--sleep-ms 50] [--engines diffusers,sglang] [--out DIR]

The sglang engine needs the sglang environment (`scripts/build_sglang_env.sh`); it is skipped without it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import Any

RECIPE = "tiny-digits-grpo"
SLEEP_S_PER_IMAGE = float(os.environ.get("MILES_BENCH_SLEEP_S", "0.05"))
WORKERS = int(os.environ.get("MILES_BENCH_REWARD_WORKERS", "4"))
_SLOTS: dict[Any, asyncio.Semaphore] = {}  # per event loop: WORKERS calls scored at once


class _DigitView:
    """The job's args as the built-in digit reward sees them."""

    def __init__(self, args: Any) -> None:
        self._args = args
        self.custom_rm_path = None
        self.rm_type = ["digit"]
        self.reward_weights = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


async def slow_digit(args: Any, samples: list[Any], **kwargs: Any) -> list[float]:
    """The digit reward, then SLEEP_S_PER_IMAGE seconds per image on WORKERS workers, the call split evenly over
    them (waiting, not computing: a reward model elsewhere, as a pool of WORKERS would score it)."""
    from miles.rewards.dispatch import batched_async_rm

    rewards = await batched_async_rm(_DigitView(args), samples)
    slots = _SLOTS.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(WORKERS))
    size = -(-len(samples) // WORKERS)  # a call split evenly over the workers, as a reward pool splits it

    async def work(count: int) -> None:
        async with slots:
            await asyncio.sleep(SLEEP_S_PER_IMAGE * count)

    await asyncio.gather(*(work(len(samples[i : i + size])) for i in range(0, len(samples), size)))
    return rewards


def run(engine: str, mode: str, rollouts: int, out: Path) -> list[dict]:
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    run_dir = out / f"{engine}-{mode}"
    if not (run_dir / "metrics.jsonl").is_file():
        argv = ["rollout-only", "--recipe", RECIPE, "--num-rollout", str(rollouts), "--output-dir", str(run_dir)]
        argv += ["--custom-rm-path", "reward_overlap.slow_digit", "--skip-eval-before-train"]
        if engine == "sglang":
            argv += ["--rollout-backend", "sglang"]
        if mode == "after":
            argv += ["--group-rm"]
        if miles(argv):
            raise SystemExit(f"the {engine} {mode} run failed; see {run_dir}/logs")
    return read_metrics(run_dir / "metrics.jsonl")


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if key in r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=4, help="reward calls scored at once")
    parser.add_argument("--engines", default="diffusers,sglang")
    parser.add_argument("--out", type=Path, default=Path("runs/reward_overlap"))
    opts = parser.parse_args()
    os.environ["MILES_BENCH_SLEEP_S"] = str(opts.sleep_ms / 1000.0)
    os.environ["MILES_BENCH_REWARD_WORKERS"] = str(opts.workers)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    lines = [
        "| engine | scoring | generate s | rollout s | rollout / generate | reward tail s |",
        "|---|---|---|---|---|---|",
    ]
    for engine in opts.engines.split(","):
        if engine == "sglang" and not _sglang_available():
            print("[reward_overlap] no sglang environment (scripts/build_sglang_env.sh): sglang skipped")
            continue
        results = {mode: run(engine, mode, opts.rollouts, opts.out) for mode in ("streamed", "after")}
        for mode, rows in results.items():
            gen, roll = median(rows, "perf/generate_time"), median(rows, "perf/rollout_time")
            tail = median(rows, "perf/reward_time")
            lines.append(f"| {engine} | {mode} | {gen:.2f} | {roll:.2f} | {roll / gen:.3f} | {tail:.2f} |")
        saved = median(results["after"], "perf/rollout_time") / median(results["streamed"], "perf/rollout_time")
        lines.append(f"| {engine} | after / streamed rollout time | | | {saved:.3f} | |")
    print(f"\nreward of {opts.sleep_ms:g} ms per image on {opts.workers} workers, {opts.rollouts} rollouts each:\n")
    print("\n".join(lines))
    return 0


def _sglang_available() -> bool:
    from pathlib import Path as _Path

    env = os.environ.get("MILES_SGLANG_PYTHON") or str(_Path.home() / ".cache/miles/sglang-env/bin/python")
    return _Path(env).is_file()


if __name__ == "__main__":
    sys.exit(main())
