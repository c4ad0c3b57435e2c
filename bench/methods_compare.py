"""Flow-GRPO against its newer variants on the same job: tiny-digits (tiny-sd3, digit reward), the same prompts and
seeds, one machine, one sitting, interleaved.

Each recipe trains `--rollouts` rollouts (default 20) in chunks that end at the `--checkpoints` rollout ids (default
5, 10, 20): every recipe runs its first chunk, then every recipe its second, and so on, each chunk resuming the
recipe's own `--save` checkpoint, so a slow or a fast stretch of the machine falls on all of them alike. It prints a
markdown table: the rollout reward (`rollout/reward/raw_mean`) at the first rollout and at each checkpoint (the mean
of the 3 rollouts ending there, as the recipes' own comments measure it), the denoiser calls per rollout
(`rollout/denoiser_calls`, counted by the engine) and the wall time per rollout (the median `perf/step_time`:
generate, score, train, sync), with each one's ratio to Flow-GRPO's measured in the same run; then `miles eval` of
each recipe's export at every checkpoint with one sampler for all (`eval at N`: the digit reward on the 360 test
prompts, 10 Euler steps), since each method's rollout reward is measured on its own sampler.

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


def done_to(run: Path) -> int:
    """How many rollouts a recipe's run has logged (0 when it has not started)."""
    from miles.io.metrics import read_metrics

    path = run / "metrics.jsonl"
    return 1 + max((r["rollout_id"] for r in read_metrics(path)), default=-1) if path.is_file() else 0


def keep_rows_to(run: Path, last: int) -> None:
    """Drop the metrics rows past rollout `last` (a chunk interrupted after its checkpoint): the resumed job logs
    those rollouts again, and the metrics file is append-only."""
    path = run / "metrics.jsonl"
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(line + "\n" for line in lines if json.loads(line)["rollout_id"] <= last))


def run_chunks(recipes: list[str], checkpoints: list[int], out: Path) -> dict[str, list[dict]]:
    """Train every recipe chunk by chunk (skipping the chunks a previous call finished); after each chunk the
    exported pipeline is kept as `exports/at_<end>` for `eval_exports`."""
    import shutil

    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    for end in checkpoints:
        for recipe in recipes:
            run = out / recipe
            if done_to(run) >= end:
                continue
            ckpt = run / "ckpt"
            argv = ["train", "rl", "--recipe", recipe, "--num-rollout", str(end), "--output-dir", str(run)]
            argv += ["--save", str(ckpt), "--save-interval", str(end)]
            if (ckpt / "latest_checkpointed_iteration.txt").is_file():
                argv += ["--load", str(ckpt)]
                keep_rows_to(run, int((ckpt / "latest_checkpointed_iteration.txt").read_text()))
            start = time.perf_counter()
            rc = miles(argv)
            took = time.perf_counter() - start
            print(f"[methods_compare] {recipe} to rollout {end}: rc {rc}, {took:.0f} s", flush=True)
            if rc:
                raise SystemExit(f"{recipe} failed (rc {rc}); see {run}/logs")
            shutil.copytree(run / "checkpoint", run / "exports" / f"at_{end}", dirs_exist_ok=True)
    return {recipe: read_metrics(out / recipe / "metrics.jsonl") for recipe in recipes}


def eval_exports(recipes: list[str], checkpoints: list[int], out: Path) -> dict[str, dict[int, float]]:
    """`miles eval` of every kept export on the recipes' own eval set (the 360 digits test prompts), all with the
    same sampler (10 Euler steps, CFG 4, the eval seeds): the digit reward, whatever sampler each method trained on."""
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    scores: dict[str, dict[int, float]] = {}
    for recipe in recipes:
        scores[recipe] = {}
        for end in checkpoints:
            export = out / recipe / "exports" / f"at_{end}"
            if not export.is_dir():
                continue
            target = out / recipe / "evals" / f"at_{end}"
            if not (target / "metrics.jsonl").is_file():
                argv = ["eval", "--recipe", BASELINE, "--hf-checkpoint", str(export), "--output-dir", str(target)]
                if miles(argv):
                    raise SystemExit(f"miles eval of {export} failed")
            (row,) = read_metrics(target / "metrics.jsonl")
            scores[recipe][end] = float(row["eval/digits/reward_mean"])
    return scores


def eval_start(out: Path) -> float:
    """The same evaluation of the recipes' common start point (`tiny-sd3-digits-sft-short`)."""
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    target = out / "start_eval"
    if not (target / "metrics.jsonl").is_file() and miles(["eval", "--recipe", BASELINE, "--output-dir", str(target)]):
        raise SystemExit("miles eval of the start point failed")
    (row,) = read_metrics(target / "metrics.jsonl")
    return float(row["eval/digits/reward_mean"])


def table(results: dict[str, list[dict]], checkpoints: list[int], evals: dict[str, dict[int, float]]) -> str:
    base = results.get(BASELINE)
    head = ["recipe", "reward at 0", *(f"reward at {c}" for c in checkpoints), "gain", "denoiser calls / rollout"]
    head += ["wall s / rollout", *(f"eval at {c}" for c in checkpoints if any(c in e for e in evals.values()))]
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
        shown = [c for c in checkpoints if any(c in e for e in evals.values())]
        cells += [f"{evals[recipe][c]:.3f}" if c in evals.get(recipe, {}) else "" for c in shown]
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
    evals = eval_exports(recipes, checkpoints, out)
    (out / "results.json").write_text(json.dumps({"rollouts": results, "evals": evals}, indent=1) + "\n")
    print(table(results, checkpoints, evals))
    print(f"eval of the common start point (the same sampler): {eval_start(out):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
