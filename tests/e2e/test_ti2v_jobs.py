"""The TI2V-5B layout (wan2_2_ti2v on tiny-wan2_2-ti2v) through the jobs' CLI, on the embedded digits I2V task:
`train sft` of the `tiny-wan2_2-ti2v-sft` recipe for 3 steps on digits-i2v rows (evaluated by `digit_i2v`), then
`train rl` of `tiny-wan2_2-ti2v-grpo` for one small rollout from that SFT's checkpoint (as the recipe starts from a
short SFT): the trainer's recompute of the rollout's log-probs (frames >= 1) agrees with the engine's, and every
sample's latent frame 0 is its first frame's latents. Then, on the built model, a deterministic `train rl` whose
rollouts are dumped and the same training replayed from the dump with no engine give the same metrics (as
tests/e2e/test_i2v_jobs.py checks wan2_2_i2v; the flags, rows and job they share are tests/e2e/conftest.py's and
i2v_job_helpers.py's).

`extended` (the tiny build and four jobs); the parts run in the default suite (the engine, the masks and the
recompute in tests/models/test_wan2_2_ti2v.py, the recipes in tests/config).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from i2v_job_helpers import SMALL, live_then_replay
from sft_helpers import short_sft

from miles.io.metrics import read_metrics
from miles_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def tiny_wan2_2_ti2v_dir(miles_session_home: Path) -> Path:
    """tiny-wan2_2-ti2v with a 5-step VAE fit (the build tests/models/test_wan2_2_ti2v.py makes, shared on disk)."""
    from miles.builtin.tiny.wan2_2_ti2v import build_tiny_wan2_2_ti2v
    from miles.models.tiny.metadata import current_design

    name = f"tiny-wan2_2-ti2v-design{current_design('tiny-wan2_2-ti2v')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_wan2_2_ti2v(path, progress=False, vae_steps=5)
    return path


def test_sft_then_grpo_on_the_digits_i2v_task(tiny_wan2_2_ti2v_dir: Path, i2v_rows, tmp_path: Path) -> None:
    import torch

    sft = tmp_path / "sft"
    rows = short_sft("tiny-wan2_2-ti2v-sft", tiny_wan2_2_ti2v_dir, i2v_rows["sft"], "i2v", i2v_rows["test"], sft)
    final = rows[-1]
    assert final["eval/i2v/num_samples"] == 2 and 0.0 <= final["eval/i2v/reward_mean"] <= 1.0

    rl = tmp_path / "rl"
    argv = ["train", "rl", "--recipe", "tiny-wan2_2-ti2v-grpo", "--hf-checkpoint", str(sft / "checkpoint")]
    flags = ["--prompt-data", str(i2v_rows["train"]), "--eval-prompt-data", "i2v", str(i2v_rows["test"]), *SMALL]
    dump = tmp_path / "dump"
    assert main([*argv, *flags, "--num-rollout", "1", "--dump-details", str(dump), "--output-dir", str(rl)]) == 0
    rows = read_metrics(rl / "metrics.jsonl")
    train = next(r for r in rows if "train/loss" in r)
    assert 0.0 <= train["rollout/reward/raw_mean"] <= 1.0  # digit_i2v read each sample's first frame
    print(f"TI2V GRPO: log_prob_mean_abs_diff {train['train/log_prob_mean_abs_diff']:.3g}")
    assert train["train/log_prob_mean_abs_diff"] <= 1e-5
    assert rows[-1]["eval/i2v/num_samples"] == 2

    from miles.io.rollout_file import load_rollout

    _, samples, _ = load_rollout(dump / "rollout_data" / "0.pt")
    assert len(samples) == 8
    for s in samples:
        c0 = s.conditions.positive["first_frame"]
        assert all(torch.equal(x[:, :1], c0) for x in s.trajectory.latents[1:])  # frame 0 held, never noised
        assert s.image.shape == (3, 5, 64, 64)


# ---- a job on the tiny build itself: live training and its replay --------------------------------------------------
def test_live_training_and_its_replay_agree(tiny_wan2_2_ti2v_dir: Path, i2v_rows, tiny_clip, tmp_path: Path) -> None:
    """A replayed rollout trains to the same `train/*` metrics as the live one (`live_then_replay`); the rollout
    file carries the first frame's latents, and latent frame 0 of every step is that condition, never noised."""
    import torch

    from miles.io.rollout_file import load_rollout

    dump = live_then_replay("tiny-wan2_2-ti2v-grpo", tiny_wan2_2_ti2v_dir, i2v_rows, tiny_clip, tmp_path)
    _, samples, _ = load_rollout(dump.format(rollout_id=0))
    for s in samples:
        first_frame = s.conditions.positive["first_frame"]
        assert first_frame.shape == (2, 1, 16, 16)  # the first frame's latents
        assert s.trajectory.latents.shape[1:] == (2, 5, 16, 16)  # latent frame 0 among them
        assert all(torch.equal(x[:, :1], first_frame) for x in s.trajectory.latents)  # frame 0 held, never noised
