"""The edit families' shared job of their tests (tests/e2e/test_edit_jobs.py, test_qwen_edit_jobs.py): both run
the digits-edit task through the same CLI, each with its own tiny build and recipes."""

from __future__ import annotations

from pathlib import Path

from sft_helpers import short_sft

from miles.io.metrics import read_metrics
from miles_cli.main import main


def sft_then_eval(checkpoint: Path, rows: dict[str, Path], sft_recipe: str, eval_recipe: str, tmp: Path) -> dict:
    """3 SFT steps of `sft_recipe` on the edit SFT rows (evaluated on 4 edit rows), then `miles eval` of its checkpoint
    with `eval_recipe`'s settings; -> the eval job's row. Each job reports `digit_edit` on the 4 rows."""
    sft = tmp / "sft"
    metrics = short_sft(sft_recipe, checkpoint, rows["sft"], "edit", rows["train"], sft)
    assert metrics[-1]["eval/edit/num_samples"] == 4
    out = tmp / "eval"
    ev = ["eval", "--recipe", eval_recipe, "--hf-checkpoint", str(sft / "checkpoint")]
    ev += ["--eval-prompt-data", "edit", str(rows["train"])]
    assert main([*ev, "--output-dir", str(out)]) == 0
    (row,) = read_metrics(out / "metrics.jsonl")
    return row
