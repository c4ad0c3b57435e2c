"""The image-to-video family (wan2_2_i2v on tiny-wan2_2-i2v) through the jobs' CLI, on the embedded digits I2V task:
`train sft` of the `tiny-wan2_2-i2v-sft` recipe for a few steps on digits-i2v rows (evaluated by `digit_i2v`), then
`train rl` of `tiny-wan2_2-i2v-grpo` for one small rollout from that SFT's checkpoint (as the recipe starts from a
short SFT), each sample scored against its first frame.

About two and a half minutes on 2 cores (the tiny build, two jobs): `extended`; the parts run in the default suite
(the engine and the recompute in tests/models/test_wan2_2_i2v.py, the reward in
tests/rewards/test_digit_i2v_reward.py, the recipes in tests/config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "4"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4", "--lr-warmup-iters", "0"]


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


@pytest.fixture(scope="module")
def i2v_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The digits-i2v set written for the first 8 train and 2 test digits (the set's own writer)."""
    import miles.data.digits_i2v as digits_i2v
    from miles.data.digits import DigitsSplit, load_digits_split

    split = load_digits_split()
    small = DigitsSplit(split.train_x[:8], split.train_y[:8], split.test_x[:2], split.test_y[:2])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(digits_i2v, "load_digits_split", lambda seed=0: small)
        return digits_i2v.write_digits_i2v_data(tmp_path_factory.mktemp("digits-i2v"))


def test_sft_then_grpo_on_the_digits_i2v_task(tiny_wan2_2_i2v_dir: Path, i2v_rows, tmp_path: Path) -> None:
    sft = tmp_path / "sft"
    argv = ["train", "sft", "--recipe", "tiny-wan2_2-i2v-sft", "--hf-checkpoint", str(tiny_wan2_2_i2v_dir)]
    flags = ["--prompt-data", str(i2v_rows["sft"]), "--eval-prompt-data", "i2v", str(i2v_rows["test"])]
    flags += ["--num-rollout", "3", "--global-batch-size", "4", "--micro-batch-size", "4"]
    flags += ["--diffusion-num-steps", "4"]
    assert main([*argv, *flags, "--output-dir", str(sft)]) == 0
    rows = read_metrics(sft / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows if "train/loss" in r] == [0, 1, 2]
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
