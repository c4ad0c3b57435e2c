"""Flow-GRPO against its newer variants on the same job: tiny-digits (tiny-sd3, digit reward), the same prompts and
seeds, one machine, one sitting, interleaved.

Each recipe trains `--rollouts` rollouts (default 20) in chunks that end at the `--checkpoints` rollout ids (default
5, 10, 20): every recipe runs its first chunk, then every recipe its second, and so on, each chunk resuming the
recipe's own `--save` checkpoint, so a slow or a fast stretch of the machine falls on all of them alike. It prints a
markdown table: the rollout reward (`rollout/reward/raw_mean`) at the first rollout and at each checkpoint (the mean
of the 3 rollouts ending there, as the recipes' own comments measure it), the denoiser calls per rollout
(`rollout/denoiser_calls`, counted by the engine) and the wall time per rollout (the median `perf/step_time`:
generate, score, train, sync), with each one's ratio to Flow-GRPO's measured in the same run.

    python bench/methods_compare.py [--rollouts 20] [--checkpoints 5,10,20] [--recipes a,b,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

RECIPES = (
    "tiny-digits-grpo",
    "tiny-digits-grpo-fast",
    "tiny-digits-mixgrpo",
    "tiny-digits-mixgrpo-flash",
    "tiny-digits-grpo-guard",
    "tiny-digits-dpo",
)
BASELINE = "tiny-digits-grpo"


def window_mean(rows: list[dict], end: int, key: str = "rollout/reward/raw_mean", width: int = 3) -> float:
    """The mean of `key` over the `width` rollouts ending at rollout id `end - 1`."""
    values = [r[key] for r in rows if end - width <= r["rollout_id"] < end and key in r]
    return statistics.fmean(values)


def run_chunks(recipes: list[str], checkpoints: list[int], out: Path) -> dict[str, list[dict]]:
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    for end in checkpoints:
        for recipe in recipes:
            run = out / recipe
            ckpt = run / "ckpt"
            argv = ["train", "rl", "--recipe", recipe, "--num-rollout", str(end), "--output-dir", str(run)]
            argv += ["--save", str(ckpt), "--save-interval", str(end)]
            if (ckpt / "latest_checkpointed_iteration.txt").is_file():
                argv += ["--load", str(ckpt)]
            start = time.perf_counter()
            rc = miles(argv)
            took = time.perf_counter() - start
            print(f"[methods_compare] {recipe} to rollout {end}: rc {rc}, {took:.0f} s", flush=True)
            if rc:
                raise SystemExit(f"{recipe} failed (rc {rc}); see {run}/logs")
    return {recipe: read_metrics(out / recipe / "metrics.jsonl") for recipe in recipes}


def table(results: dict[str, list[dict]], checkpoints: list[int]) -> str:
    base = results.get(BASELINE)
    head = ["recipe", "reward at 0", *(f"reward at {c}" for c in checkpoints), "gain", "denoiser calls / rollout"]
    head += ["wall s / rollout"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base_calls = statistics.median(r["rollout/denoiser_calls"] for r in base) if base else None
    base_wall = statistics.median(r["perf/step_time"] for r in base[1:]) if base else None
    for recipe, rows in results.items():
        first = rows[0]["rollout/reward/raw_mean"]
        at = [window_mean(rows, c) for c in checkpoints]
        calls = statistics.median(r["rollout/denoiser_calls"] for r in rows)
        wall = statistics.median(r["perf/step_time"] for r in rows[1:])  # rollout 0 warms up
        cells = [f"`{recipe}`", f"{first:.3f}", *(f"{a:.3f}" for a in at), f"{at[-1] - first:+.3f}"]
        cells.append(f"{calls:,.0f}" + (f" ({calls / base_calls:.2f}x)" if base_calls else ""))
        cells.append(f"{wall:.1f}" + (f" ({wall / base_wall:.2f}x)" if base_wall else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--checkpoints", default="5,10,20")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default="runs/methods_compare")
    opts = parser.parse_args()
    checkpoints = sorted({int(c) for c in opts.checkpoints.split(",")} | {opts.rollouts})
    checkpoints = [c for c in checkpoints if c <= opts.rollouts]
    recipes = [r.strip() for r in opts.recipes.split(",") if r.strip()]
    out = Path(opts.out)
    results = run_chunks(recipes, checkpoints, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, checkpoints))
    return 0


if __name__ == "__main__":
    sys.exit(main())
