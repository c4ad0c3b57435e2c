"""The image-to-video family (wan2_2_i2v on tiny-wan2_2-i2v) through the jobs' CLI, on the embedded digits I2V task:
`train sft` of the `tiny-wan2_2-i2v-sft` recipe for a few steps on digits-i2v rows (evaluated by `digit_i2v`), then
`train rl` of `tiny-wan2_2-i2v-grpo` for one small rollout from that SFT's checkpoint (as the recipe starts from a
short SFT), each sample scored against its first frame. Then the jobs that do not train live on the built model: a
deterministic `train rl` whose rollouts are dumped and the same training replayed from the dump with no engine give
the same metrics; `miles eval` on digits-i2v:test rows reports `digit_i2v` and the task's metrics; `miles
rollout-only` writes rollout files that carry the condition as tensors and load with `weights_only=True`.

About 13 minutes on 2 cores shared with other jobs (the tiny build, six jobs, most of it Ray and engine
start-up): `extended`; the parts run in the default suite
(the engine and the recompute in tests/models/test_wan2_2_i2v.py, the reward in
tests/rewards/test_digit_i2v_reward.py, the recipes in tests/config).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from i2v_job_helpers import SMALL, live_then_replay, run_i2v_job
from sft_helpers import short_sft

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def tiny_wan2_2_i2v_dir(miles_session_home: Path) -> Path:
    """tiny-wan2_2-i2v with a 5-step VAE fit (the build tests/models/test_wan2_2_i2v.py makes, shared on disk)."""
    from miles.builtin.tiny.wan2_2_i2v import build_tiny_wan2_2_i2v
    from miles.models.tiny.metadata import current_design

    name = f"tiny-wan2_2-i2v-design{current_design('tiny-wan2_2-i2v')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_wan2_2_i2v(path, progress=False, vae_steps=5)
    return path


def test_sft_then_grpo_on_the_digits_i2v_task(tiny_wan2_2_i2v_dir: Path, i2v_rows, tmp_path: Path) -> None:
    sft = tmp_path / "sft"
    rows = short_sft("tiny-wan2_2-i2v-sft", tiny_wan2_2_i2v_dir, i2v_rows["sft"], "i2v", i2v_rows["test"], sft)
    final = rows[-1]
    assert final["eval/i2v/num_samples"] == 2 and 0.0 <= final["eval/i2v/reward_mean"] <= 1.0
    assert "eval/i2v/direction_acc" in final  # the videos read per frame, though each sample has its source

    rl = tmp_path / "rl"
    argv = ["train", "rl", "--recipe", "tiny-wan2_2-i2v-grpo", "--hf-checkpoint", str(sft / "checkpoint")]
    flags = ["--prompt-data", str(i2v_rows["train"]), "--eval-prompt-data", "i2v", str(i2v_rows["test"]), *SMALL]
    dump = tmp_path / "dump"
    assert main([*argv, *flags, "--num-rollout", "1", "--dump-details", str(dump), "--output-dir", str(rl)]) == 0
    rows = read_metrics(rl / "metrics.jsonl")
    train = next(r for r in rows if "train/loss" in r)
    assert 0.0 <= train["rollout/reward/raw_mean"] <= 1.0  # digit_i2v read each sample's first frame
    assert train["train/log_prob_mean_abs_diff"] <= 1e-5
    assert rows[-1]["eval/i2v/num_samples"] == 2

    from miles.io.rollout_file import load_rollout

    _, samples, _ = load_rollout(dump / "rollout_data" / "0.pt")
    prompts = [json.loads(line) for line in i2v_rows["train"].read_text().splitlines()]
    assert len(samples) == 8 and {s.prompt for s in samples} <= {p["input"] for p in prompts}
    assert all(s.sources is not None and s.sources[0].shape == (3, 64, 64) for s in samples)
    assert all(s.image.shape == (3, 5, 64, 64) for s in samples)  # the recipe's 5-frame clips


# ---- the jobs that do not train live: replay, eval, rollout-only --------------------------------------------------
_job = partial(run_i2v_job, "tiny-wan2_2-i2v-grpo")  # TINY flags, digit_i2v + clip_i (i2v_job_helpers.py)


def test_live_training_and_its_replay_agree(tiny_wan2_2_i2v_dir: Path, i2v_rows, tiny_clip, tmp_path: Path) -> None:
    """A replayed rollout trains to the same `train/*` metrics as the live one (`live_then_replay`); the rollout
    file carries the condition as tensors: the first-frame condition latents, and the generated channels only."""
    from miles.io.rollout_file import load_rollout

    dump = live_then_replay("tiny-wan2_2-i2v-grpo", tiny_wan2_2_i2v_dir, i2v_rows, tiny_clip, tmp_path)
    _, samples, _ = load_rollout(dump.format(rollout_id=0))
    assert all(s.conditions.positive["image_condition"].shape == (3, 5, 16, 16) for s in samples)
    assert all(s.trajectory.latents.shape[1:] == (2, 5, 16, 16) for s in samples)  # the generated channels only


def test_eval_on_digits_i2v_test_rows(tiny_wan2_2_i2v_dir: Path, i2v_rows, tiny_clip, tmp_path: Path) -> None:
    """`miles eval` on two digits-i2v:test rows, two samples each: digit_i2v by name (and clip_i), and the task's
    metrics: per-frame accuracy, fd (20 frames read) and direction accuracy."""
    model = (tiny_wan2_2_i2v_dir, i2v_rows, tiny_clip)
    (row,) = _job(["eval"], *model, tmp_path / "eval", "--n-samples-per-eval-prompt", "2")
    assert row["eval/i2v/num_samples"] == 4
    for name in ("digit_i2v", "clip_i"):
        assert 0.0 <= row[f"eval/i2v/{name}/reward_mean"] <= 1.0
    parts = row["eval/i2v/digit_i2v/reward_mean"] + row["eval/i2v/clip_i/reward_mean"]
    assert row["eval/i2v/reward_mean"] == pytest.approx(parts)  # weight 1 each
    assert 0.0 <= row["eval/i2v/accuracy"] <= 1.0 and 0.0 <= row["eval/i2v/direction_acc"] <= 1.0
    assert row["eval/i2v/fd"] >= 0.0


def test_rollout_only_files_carry_the_condition_as_tensors(
    tiny_wan2_2_i2v_dir: Path, i2v_rows, tiny_clip, tmp_path: Path
) -> None:
    """`miles rollout-only`: its rollout file loads with `torch.load(weights_only=True)`, and each sample carries its
    first frame (`sources`, the row's PNG) and the encoded condition (`image_condition`, in both branches, shared by
    its group) as tensors."""
    import numpy as np
    import torch
    from PIL import Image

    out = tmp_path / "rollouts"
    (row,) = _job(["rollout-only"], tiny_wan2_2_i2v_dir, i2v_rows, tiny_clip, out, "--num-rollout", "1")
    assert 0.0 <= row["rollout/reward/digit_i2v/raw_mean"] <= 1.0 and not any(k.startswith("train/") for k in row)
    raw = torch.load(out / "rollout_0.pt", weights_only=True)
    assert raw["rollout_id"] == 0 and len(raw["samples"]) == 4
    for sample in raw["samples"]:
        (source,) = sample["sources"]
        assert isinstance(source, torch.Tensor) and source.shape == (3, 64, 64)
        (path,) = sample["media"]
        png = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255
        assert torch.allclose(source, png, atol=1e-6)  # the row's first frame, decoded
        conditions = sample["conditions"]
        for branch in ("positive", "negative"):
            condition = conditions[branch]["image_condition"]
            assert isinstance(condition, torch.Tensor) and condition.shape == (3, 5, 16, 16)  # mask + first frame
        assert torch.equal(conditions["positive"]["image_condition"], conditions["negative"]["image_condition"])
    first, second = ([s for s in raw["samples"] if s["group_index"] == g] for g in (0, 1))
    assert torch.equal(
        first[0]["conditions"]["positive"]["image_condition"], first[1]["conditions"]["positive"]["image_condition"]
    )
    assert not torch.equal(
        first[0]["conditions"]["positive"]["image_condition"], second[0]["conditions"]["positive"]["image_condition"]
    )
