"""The reward-hacking guard on a deliberately hackable proxy (recipe `tiny-digits-grpo-hackable`: the digit reward
plus 20x the image's mean brightness, gold = the digit reward alone on the 360 digits test prompts every 2 rollouts).

Two runs of the same job: unguarded (`--reward-guard warn`: it says when it would act and trains on) and guarded
(`--reward-guard rollback`: it ends at the best gold evaluation's weights and exports them). It prints the proxy and
gold per rollout, evaluates the guarded run's export with `miles eval` (gold = the digit reward), and draws both runs'
curves to `docs/media/reward_guard.png`.

    python bench/reward_guard_demo.py [--out runs/reward_guard] [--rollouts 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RECIPE = "tiny-digits-grpo-hackable"


def run(policy: str, out: Path, rollouts: int) -> list[dict]:
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    if not (out / "metrics.jsonl").is_file():
        argv = ["train", "rl", "--recipe", RECIPE, "--reward-guard", policy, "--num-rollout", str(rollouts)]
        if miles([*argv, "--output-dir", str(out)]):
            raise SystemExit(f"the {policy} run failed; see {out}/logs")
    return read_metrics(out / "metrics.jsonl")


def eval_export(run_dir: Path) -> float:
    """`miles eval` of a run's exported pipeline: its gold (the recipe's --gold-rm-type, the digit reward) on the
    digits test prompts."""
    from miles.io.metrics import read_metrics
    from miles_cli.main import main as miles

    out = run_dir / "eval_export"
    if not (out / "metrics.jsonl").is_file():
        argv = ["eval", "--recipe", RECIPE, "--hf-checkpoint", str(run_dir / "checkpoint"), "--output-dir", str(out)]
        if miles(argv):
            raise SystemExit(f"miles eval of {run_dir}/checkpoint failed")
    (row,) = read_metrics(out / "metrics.jsonl")
    return float(row["eval/digits/gold_reward_mean"])


def plot(runs: dict[str, list[dict]], exported: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    proxy_ax, gold_ax, div_ax = fig.subplots(1, 3)
    for name, rows in runs.items():
        trained = [r for r in rows if "rollout/reward/raw_mean" in r]
        proxy_ax.plot([r["rollout_id"] for r in trained], [r["rollout/reward/raw_mean"] for r in trained], label=name)
        evals = [r for r in rows if "guard/gold_reward" in r]
        gold_ax.plot([r["rollout_id"] for r in evals], [r["guard/gold_reward"] for r in evals], "o-", label=name)
        div = [r for r in rows if "rollout/diversity" in r]
        div_ax.plot([r["rollout_id"] for r in div], [r["rollout/diversity"] for r in div], label=name)
    last = max(r["rollout_id"] for r in runs["guarded (rollback)"] if "guard/gold_reward" in r)
    gold_ax.plot([last], [exported], "*", markersize=14, color="tab:green", label="guarded run's export")
    for ax, title in ((proxy_ax, "proxy (digit + 20 x ink)"), (gold_ax, "gold (digit reward, eval)")):
        ax.set_title(title)
        ax.set_xlabel("rollout")
    div_ax.set_title("intra-group diversity")
    div_ax.set_xlabel("rollout")
    gold_ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/reward_guard")
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--figure", default="docs/media/reward_guard.png")
    opts = parser.parse_args()
    out = Path(opts.out)
    runs = {
        "unguarded (warn)": run("warn", out / "warn", opts.rollouts),
        "guarded (rollback)": run("rollback", out / "rollback", opts.rollouts),
    }
    for name, rows in runs.items():
        print(f"{name}:")
        for r in rows:
            proxy = r.get("rollout/reward/raw_mean")
            gold = r.get("guard/gold_reward")
            cells = [f"rollout {r['rollout_id']:>2}"]
            cells.append(f"proxy {proxy:7.3f}" if proxy is not None else " " * 13)
            cells.append(f"gold {gold:.3f}" if gold is not None else "")
            print("  " + "  ".join(cells))
    start_gold = runs["unguarded (warn)"][0]["guard/gold_reward"]
    exported = eval_export(out / "rollback")
    print(f"gold at the start {start_gold:.4f}; the guarded run's export, evaluated afresh: {exported:.4f}")
    plot(runs, exported, Path(opts.figure))
    print(f"curves: {opts.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
