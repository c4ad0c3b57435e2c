"""The reward-hacking guard inside a real `train rl` job (Ray, trainer group, engine): a gold reward that falls
triggers `rollback`, which ends the job at the best gold reward's weights and exports them (here the start point,
evaluated before any training), and `stop`, which ends it and exports the weights it has.

The gold reward is a real reward function (`--gold-rm-type guard_gold.scripted`) whose value follows a script:
evaluation k scores every sample `GOLD[k]`, so the test knows when the guard must act."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = pytest.mark.slow

GOLD_MODULE = """
import os
from pathlib import Path

GOLD = [0.9, 0.5, 0.4, 0.3, 0.2]


def scripted(args, samples):
    calls = Path(os.environ["GUARD_GOLD_CALLS"])
    k = len(calls.read_text()) if calls.exists() else 0
    calls.write_text("x" * (k + 1))
    return [GOLD[min(k, len(GOLD) - 1)]] * len(samples)
"""

SMALL = [
    "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
    "--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "4",
    "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4", "--lr", "1e-3", "--lr-warmup-iters", "0",
]  # fmt: skip


@pytest.fixture
def gold_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "guard_gold.py").write_text(GOLD_MODULE)
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"input": f"a handwritten digit {k}", "metadata": {"label": k}}) + "\n" for k in range(4))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("GUARD_GOLD_CALLS", str(tmp_path / "calls.txt"))
    return tmp_path


def run(tiny_sd3_dir: Path, out: Path, tmp: Path, policy: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    argv = [
        "train", "rl", "--recipe", "tiny-digits-grpo", "--hf-checkpoint", str(tiny_sd3_dir), *SMALL,
        "--num-rollout", "5", "--eval-prompt-data", "digits", str(tmp / "eval.jsonl"), "--eval-interval", "1",
        "--gold-rm-type", "guard_gold.scripted", "--reward-guard", policy, "--reward-guard-patience", "2",
        "--output-dir", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    return read_metrics(out / "metrics.jsonl")


def transformer(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")


def test_rollback_ends_at_the_best_gold_and_exports_it(tiny_sd3_dir: Path, gold_env: Path, capsys) -> None:
    out = gold_env / "rollback"
    rows = run(tiny_sd3_dir, out, gold_env, "rollback", capsys)
    said = capsys.readouterr().out
    # evaluations at rollouts 0 (0.9, the best: the start point), 1 (0.5), 2 (0.4: two below, trigger)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert rows[2]["guard/gold_reward"] == 0.4 and rows[2]["guard/best_rollout"] == 0.0
    assert "train/loss" not in rows[2]  # the job ended before rollout 2 trained
    assert "miles: warning: reward guard (rollback): the gold reward fell to 0.4000 from its best 0.9000" in said
    assert "restored the weights of the best gold reward 0.9000 (evaluated at rollout 0)" in said
    exported, start = transformer(out / "checkpoint"), transformer(tiny_sd3_dir)
    assert exported.keys() == start.keys() and all(torch.equal(exported[k], start[k]) for k in start)
    assert (out / "reward_guard" / "best").is_dir()


# extended (~70 s, a second job): the job's loop ending at the guard's trigger and exporting runs in the default suite
# under `rollback` (the test above); what `stop` does differently there (no best checkpoint saved, nothing restored,
# the weights it has exported) is tests/runtime/test_reward_guard.py::
# test_the_runner_under_stop_ends_the_loop_and_keeps_the_weights_it_has
@pytest.mark.extended
def test_stop_ends_the_job_and_exports_the_weights_it_has(tiny_sd3_dir: Path, gold_env: Path, capsys) -> None:
    out = gold_env / "stop"
    rows = run(tiny_sd3_dir, out, gold_env, "stop", capsys)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert "miles: warning: reward guard (stop)" in capsys.readouterr().out
    exported, start = transformer(out / "checkpoint"), transformer(tiny_sd3_dir)
    assert any(not torch.equal(exported[k], start[k]) for k in start)  # two rollouts trained, nothing restored
    assert not (out / "reward_guard").exists()  # only rollback keeps the best checkpoint
