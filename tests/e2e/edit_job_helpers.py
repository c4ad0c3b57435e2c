"""The edit families' shared job of their tests (tests/e2e/test_edit_jobs.py, test_qwen_edit_jobs.py): both run
the digits-edit task through the same CLI, each with its own tiny build and recipes."""

from __future__ import annotations

from pathlib import Path

from miles.io.metrics import read_metrics
from miles_cli.main import main


def sft_then_eval(checkpoint: Path, rows: dict[str, Path], sft_recipe: str, eval_recipe: str, tmp: Path) -> None:
    """3 SFT steps of `sft_recipe` on the edit SFT rows (evaluated on 4 edit rows), then `miles eval` of its checkpoint
    with `eval_recipe`'s settings: each job reports `digit_edit` on the 4 rows."""
    sft = tmp / "sft"
    argv = ["train", "sft", "--recipe", sft_recipe, "--hf-checkpoint", str(checkpoint)]
    flags = ["--prompt-data", str(rows["sft"]), "--eval-prompt-data", "edit", str(rows["train"])]
    flags += ["--num-rollout", "3", "--global-batch-size", "4", "--micro-batch-size", "4"]
    flags += ["--diffusion-num-steps", "4"]
    assert main([*argv, *flags, "--output-dir", str(sft)]) == 0
    metrics = read_metrics(sft / "metrics.jsonl")
    assert [r["rollout_id"] for r in metrics if "train/loss" in r] == [0, 1, 2]
    assert metrics[-1]["eval/edit/num_samples"] == 4
    out = tmp / "eval"
    ev = ["eval", "--recipe", eval_recipe, "--hf-checkpoint", str(sft / "checkpoint")]
    ev += ["--eval-prompt-data", "edit", str(rows["train"])]
    assert main([*ev, "--output-dir", str(out)]) == 0
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["eval/edit/num_samples"] == 4 and 0.0 <= row["eval/edit/reward_mean"] <= 1.0
