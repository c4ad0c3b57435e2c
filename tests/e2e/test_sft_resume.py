"""`train sft` checkpoints, resume, `--eval-interval` and the `--ci-test` metric check, through the CLI.

Three small runs on a 12-row slice of `digits:sft` (batch 4, so iteration 3 starts the second epoch's
permutation): 4 iterations straight, 2 iterations, then a resume of the latter to 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

ROWS = 12


@pytest.fixture(scope="module")
def small_sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(SFT rows, eval prompts): the first 12 `digits:sft` rows (absolute image paths), two eval prompts."""
    from miles.builtin.datasets import resolve_dataset

    source = Path(resolve_dataset("digits:sft"))
    root = tmp_path_factory.mktemp("sft_sets")
    rows = [json.loads(line) for line in source.read_text().splitlines()[:ROWS]]
    for row in rows:
        row["image"] = str((source.parent / row["image"]).resolve())
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = root / "few.jsonl"
    prompts.write_text(
        "".join(f'{{"input": "a handwritten digit {d}", "metadata": {{"label": {d}}}}}\n' for d in (3, 7))
    )
    return sft, prompts


def _sft(tiny_sd3_dir: Path, data: Path, out: Path, *extra: str) -> int:
    argv = ["train", "sft", "--recipe", "tiny-digits-sft", "--hf-checkpoint", str(tiny_sd3_dir)]
    small = ["--prompt-data", str(data), "--global-batch-size", "4", "--micro-batch-size", "4", "--deterministic-mode"]
    return main([*argv, *small, "--output-dir", str(out), *extra])


def _eval_flags(prompts: Path, interval: int) -> list[str]:
    return [
        *("--eval-prompt-data", "few", str(prompts), "--n-samples-per-eval-prompt", "1"),
        *("--diffusion-eval-num-steps", "4", "--eval-interval", str(interval)),
    ]


def test_sft_resume_is_bit_identical_with_eval_and_ci_check(
    tiny_sd3_dir: Path, small_sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, prompts = small_sets
    ck_straight, ck_resumed = tmp_path / "ck_straight", tmp_path / "ck_resumed"

    # 4 straight; evals before iteration 0, at 2 and at the end (4); the CI check holds
    ci_ok = ["--ci-test", "--ci-metric-checker-key", "eval/few/num_samples", "--ci-metric-checker-threshold", "2"]
    rc = _sft(
        tiny_sd3_dir, data, tmp_path / "straight", "--num-rollout", "4", "--save", str(ck_straight),
        *_eval_flags(prompts, 2), *ci_ok,
    )  # fmt: skip
    assert rc == 0
    assert "CI check passed: eval/few/num_samples = 2 >= 2" in capsys.readouterr().out
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["rollout_id"] for r in straight] == [0, 1, 2, 3, 4]
    assert [r["rollout_id"] for r in straight if "eval/few/accuracy" in r] == [0, 2, 4]
    assert "train/loss" not in straight[4]  # the final eval has a row of its own
    assert (tmp_path / "straight" / "images" / "eval_few_2.png").is_file()
    # the job's config beside its checkpoints (for `miles export`), the last checkpoint and the pointer
    assert [p.name for p in sorted(ck_straight.iterdir())] == [
        "config.yaml",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]

    # 2 iterations, saved every one; --skip-eval-before-train: evals at 1 and at the end (2). The CI check fails
    # (exit 1, one line) after everything was written.
    ci_bad = ["--ci-test", "--ci-metric-checker-key", "train/loss", "--ci-metric-checker-threshold", "1e9"]
    rc = _sft(
        tiny_sd3_dir, data, tmp_path / "first", "--num-rollout", "2", "--save", str(ck_resumed),
        "--save-interval", "1", *_eval_flags(prompts, 1), "--skip-eval-before-train", *ci_bad,
    )  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "miles: CI check failed: train/loss = " in err and "(last logged, rollout 1)" in err
    assert "below --ci-metric-checker-threshold 1e+09" in err
    first = read_metrics(tmp_path / "first" / "metrics.jsonl")
    assert [r["rollout_id"] for r in first if "eval/few/accuracy" in r] == [1, 2]
    assert (ck_resumed / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    extra = json.loads((ck_resumed / "iter_0000001" / "extra.json").read_text())
    assert extra["rollout_id"] == 1 and extra["sft"]["sampler"] == {
        "size": ROWS,
        "seed": 1234,
        "epoch": 0,
        "offset": 8,
    }

    # resume to 4 from the latest checkpoint (iteration 1): runs 2 and 3, evaluates at 2 with the resumed weights
    rc = _sft(
        tiny_sd3_dir, data, tmp_path / "resumed", "--num-rollout", "4", "--save", str(ck_resumed),
        "--load", str(ck_resumed), *_eval_flags(prompts, 2),
    )  # fmt: skip
    assert rc == 0
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["rollout_id"] for r in resumed] == [2, 3, 4]
    for a, b in zip(straight[2:4], resumed[:2], strict=True):
        assert b["train/loss"] == a["train/loss"] and b["train/grad_norm"] == a["train/grad_norm"]
    for key in ("eval/few/accuracy", "eval/few/reward_mean"):  # the engine got the resumed weights
        assert resumed[0][key] == pytest.approx(straight[2][key], abs=1e-6), key

    # bit-identical trained weights (and optimizer state) at iteration 3
    for part in ("model.pt", "optimizer.pt"):
        a = torch.load(ck_straight / "iter_0000003" / part, weights_only=True)
        b = torch.load(ck_resumed / "iter_0000003" / part, weights_only=True)
        _assert_identical(a, b, part)
    sampler = json.loads((ck_resumed / "iter_0000003" / "extra.json").read_text())["sft"]["sampler"]
    assert (sampler["epoch"], sampler["offset"]) == (1, 4)  # 16 rows drawn from 12: one epoch and 4


def _assert_identical(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}/{i}")
    else:
        assert a == b, where
