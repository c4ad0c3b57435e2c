"""The short SFT job the conditioned families' tests start from (tests/e2e/edit_job_helpers.py, test_i2v_jobs.py,
test_ti2v_jobs.py): 3 steps of the family's SFT recipe at batch 4, evaluated with 4 denoising steps."""

from __future__ import annotations

from pathlib import Path

from miles.io.metrics import read_metrics
from miles_cli.main import main


def short_sft(recipe: str, checkpoint: Path, sft_rows: Path, eval_name: str, eval_rows: Path, out: Path) -> list[dict]:
    """`miles train sft --recipe RECIPE` for 3 steps on `sft_rows`, evaluated on `eval_rows` as `eval_name`;
    -> the job's metrics rows (its checkpoint is `out / "checkpoint"`)."""
    argv = ["train", "sft", "--recipe", recipe, "--hf-checkpoint", str(checkpoint)]
    flags = ["--prompt-data", str(sft_rows), "--eval-prompt-data", eval_name, str(eval_rows)]
    flags += ["--num-rollout", "3", "--global-batch-size", "4", "--micro-batch-size", "4"]
    flags += ["--diffusion-num-steps", "4"]
    assert main([*argv, *flags, "--output-dir", str(out)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows if "train/loss" in r] == [0, 1, 2]
    return rows
