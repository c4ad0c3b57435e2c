"""`miles train dmd2` end to end through the CLI: Ray, the colocated critic and actor groups, the final
student/teacher eval, the side-by-side grid and the exported student."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow


def test_train_dmd2_tiny_recipe_writes_metrics_eval_grid_and_checkpoint(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "few.jsonl"
    prompts.write_text(
        "".join(f'{{"input": "a handwritten digit {d}", "metadata": {{"label": {d}}}}}\n' for d in range(6))
    )
    out = tmp_path / "dmd2"
    argv = ["train", "dmd2", "--recipe", "tiny-digits-4step", "--hf-checkpoint", str(tiny_sd3_dir)]
    small = ["--num-rollout", "3", "--dmd2-critic-update-ratio", "2", "--rollout-batch-size", "4"]
    small += ["--global-batch-size", "4", "--eval-prompt-data", "digits", str(prompts)]
    small += ["--n-samples-per-eval-prompt", "2"]
    save = tmp_path / "ckpt"
    assert main([*argv, *small, "--output-dir", str(out), "--save", str(save), "--export-interval", "2"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]
    assert "train/loss" in rows[0] and "train/loss" not in rows[1] and "train/loss" in rows[2]  # TTUR 2
    for row in rows[:3]:
        assert "critic/loss" in row and "rollout/stop_step" in row
    assert rows[0]["train/x0_gen_mean_abs_diff"] <= 1e-5
    final = rows[-1]
    for variant in ("student_4step", "teacher_20step", "teacher_4step"):
        assert 0.0 <= final[f"eval/{variant}/accuracy"] <= 1.0 and final[f"eval/{variant}/fd"] >= 0.0
        assert final[f"eval/{variant}/num_samples"] == 12
    assert (out / "dmd2_grid.png").is_file()
    assert (out / "checkpoint" / "transformer").is_dir()
    # the student's periodic exports (after iteration 2 and the last) and `miles export` of its last checkpoint
    exports = out / "exports"
    assert sorted(p.name for p in exports.iterdir()) == ["iter_000002", "iter_000003", "latest.txt"]
    from safetensors.torch import load_file

    weights = Path("pipeline") / "transformer" / "diffusion_pytorch_model.safetensors"  # a full fine-tune
    assert main(["export", str(save)]) == 0
    mine, theirs = load_file(save / "exports" / "iter_0000002" / weights), load_file(exports / "iter_000003" / weights)
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)
    final = load_file(out / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(final[k].equal(theirs[k]) for k in final)

    # resume: both groups come back from --load (the critic from <load>/critic) and the run goes on at 3
    assert (save / "critic").is_dir()
    more = [arg if arg != "3" else "4" for arg in small]
    out2 = tmp_path / "dmd2_resumed"
    assert main([*argv, *more, "--output-dir", str(out2), "--load", str(save)]) == 0
    resumed = read_metrics(out2 / "metrics.jsonl")
    assert [r["rollout_id"] for r in resumed] == [3, 4]
    assert "critic/loss" in resumed[0] and "train/loss" not in resumed[0]  # iteration 3: a critic-only step
