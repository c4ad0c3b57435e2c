"""flux, flux2 (klein), z_image, qwen_image, cosmos3, wan2_2 and ltx through the jobs' CLI: `rollout-only`,
`replay` of its file, and `train dmd2` (refused with one line for ltx).

The trainer-level checks (recompute, LoRA sync, export, NFT and SFT steps) are in
tests/training/test_family_trainer.py; here each job runs as a user runs it (Ray, trainer groups, files).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from replay_helpers import LIVE_FLAGS, assert_train_metrics_agree, replay_flags

from miles.io.metrics import read_metrics
from miles.io.rollout_file import load_rollout
from miles_cli.main import main

# ~12 min of jobs (five families): the families' engines, recompute and trainers are tested in
# tests/models/test_family_engines.py and tests/models/test_families.py; these whole-CLI runs are acceptance-style
pytestmark = [pytest.mark.slow, pytest.mark.extended]

FAMILIES = {
    "flux": "tiny_flux_dir",
    "flux2": "tiny_flux2_klein_dir",
    "z_image": "tiny_z_image_dir",
    "qwen_image": "tiny_qwen_image_dir",
    "cosmos3": "tiny_cosmos3_dir",
    "wan2_2": "tiny_wan2_2_dir",
    "ltx": "tiny_ltx2_dir",
}
RECIPES = {
    "flux": "tiny-flux-digits-grpo",
    "flux2": "tiny-flux2-klein-digits-grpo",
    "z_image": "tiny-z-image-digits-grpo",
    "qwen_image": "tiny-qwen-image-digits-grpo",
    "cosmos3": "tiny-cosmos3-digits-grpo",
    "wan2_2": "tiny-wan2_2-digits-grpo",
    "ltx": "tiny-ltx2-digits-grpo",
}
# a family's own rules over the flags below (cosmos3: one sample per request; ltx's recipe draws its SDE steps
# epoch-globally from candidates, cut to the 4 steps below)
FAMILY_FLAGS = {
    "cosmos3": ["--rollout-microgroup-size", "1"],
    "ltx": ["--diffusion-sde-candidate-steps", "0,1,2,3"],
}
# a family's DMD2 flags (wan2_2: the student's timesteps cross the expert boundary, so both experts train)
DMD2_FLAGS = {"wan2_2": ["--update-weight-target-module", "transformer,transformer_2"]}
# families whose DMD2 is refused with one line (ltx: its digits data has no audio to pair)
NO_DMD2 = {"ltx"}
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4"]
SMALL += ["--global-batch-size", "8", "--micro-batch-size", "8", "--diffusion-num-steps", "4"]
SMALL += ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,4", "--lr-warmup-iters", "0"]


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(FAMILIES[request.param])


def test_rollout_only_then_replay(family, tmp_path: Path) -> None:
    name, checkpoint = family
    flags = ["--recipe", RECIPES[name], "--hf-checkpoint", str(checkpoint), *SMALL, *FAMILY_FLAGS.get(name, [])]
    out = tmp_path / "rollouts"
    assert main(["rollout-only", *flags, "--num-rollout", "1", "--output-dir", str(out)]) == 0
    rollout_id, samples, _ = load_rollout(out / "rollout_0.pt")
    assert rollout_id == 0 and len(samples) == 8
    assert all(s.trajectory.log_probs.shape == (2,) for s in samples)
    assert all(s.trajectory.latents.shape[1:] == samples[0].trajectory.latents.shape[1:] for s in samples)
    (row,) = read_metrics(out / "metrics.jsonl")
    assert 0.0 <= row["rollout/reward/raw_mean"] <= 1.0

    replay = tmp_path / "replay"
    assert main(["replay", str(out / "rollout_0.pt"), *flags, "--output-dir", str(replay)]) == 0
    (row,) = read_metrics(replay / "metrics.jsonl")
    assert row["replay/num_samples"] == 8 and torch.isfinite(torch.tensor(row["train/loss"]))
    assert row["train/log_prob_mean_abs_diff"] <= 1e-5, name  # the rollout's policy, recomputed by the trainer

    # `miles eval` of the checkpoint on two of the recipe's own prompts
    from miles.builtin.datasets import resolve_dataset
    from miles.config.resolve import resolve

    spec = resolve("rl", recipe=RECIPES[name], cli={"hf_checkpoint": str(checkpoint)}).args.prompt_data
    two = tmp_path / "two.jsonl"
    two.write_text("".join(resolve_dataset(spec).read_text().splitlines(keepends=True)[:2]))
    evaluated = tmp_path / "eval"
    assert main(["eval", *flags, "--eval-prompt-data", "two", str(two), "--output-dir", str(evaluated)]) == 0
    (row,) = read_metrics(evaluated / "metrics.jsonl")
    assert row["eval/two/num_samples"] == 2 and 0.0 <= row["eval/two/reward_mean"] <= 1.0


def test_train_dmd2(family, tmp_path: Path) -> None:
    name, checkpoint = family
    prompts = tmp_path / "few.jsonl"
    prompts.write_text(
        "".join(f'{{"input": "a handwritten digit {d}", "metadata": {{"label": {d}}}}}\n' for d in (3, 7))
    )
    out = tmp_path / "dmd2"
    argv = ["train", "dmd2", "--recipe", "tiny-digits-4step", "--hf-checkpoint", str(checkpoint)]
    argv += ["--num-rollout", "2", "--dmd2-critic-update-ratio", "1", "--rollout-batch-size", "4"]
    argv += ["--global-batch-size", "4", "--micro-batch-size", "4", "--eval-prompt-data", "digits", str(prompts)]
    argv += ["--output-dir", str(out), *FAMILY_FLAGS.get(name, []), *DMD2_FLAGS.get(name, [])]
    if name in NO_DMD2:
        assert main(argv) == 2  # a usage error, one line (tests/models/test_ltx_rules.py checks its text)
        return
    assert main(argv) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows[:2]:
        assert torch.isfinite(torch.tensor([row["train/loss"], row["critic/loss"]])).all()
    assert rows[0]["train/x0_gen_mean_abs_diff"] <= 1e-5, name  # the student's x0: engine == trainer
    assert rows[-1]["eval/student_4step/num_samples"] == 2
    assert (out / "checkpoint" / "transformer").is_dir()


def _two_prompts(folder: Path) -> Path:
    prompts = folder / "two.jsonl"
    rows = (f'{{"input": "a handwritten digit {d}", "metadata": {{"label": {d}}}}}\n' for d in (3, 7))
    prompts.write_text("".join(rows))
    return prompts


@pytest.mark.parametrize("name", ["flux2", "z_image"])
def test_a_replayed_rollout_trains_as_the_live_one(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Two deterministic rollouts trained live (rollouts dumped), then the same two trainings from the dump with no
    engine: the same `train/*` metrics (the families added last; the others' replays are the test above)."""
    checkpoint = request.getfixturevalue(FAMILIES[name])
    flags = ["--recipe", RECIPES[name], "--hf-checkpoint", str(checkpoint), *SMALL]
    dump = str(tmp_path / "dump" / "{rollout_id}.pt")
    live_out, replay_out = tmp_path / "live", tmp_path / "replay"
    argv = ["train", "rl", *flags, *LIVE_FLAGS, "--save-debug-rollout-data", dump, "--skip-eval-before-train"]
    argv += ["--eval-prompt-data", "two", str(_two_prompts(tmp_path)), "--output-dir", str(live_out)]
    assert main(argv) == 0
    live = read_metrics(live_out / "metrics.jsonl")
    assert all(r["train/grad_norm"] > 0 for r in live if "train/loss" in r)
    argv = ["train", "rl", *flags, *LIVE_FLAGS, *replay_flags(dump), "--output-dir", str(replay_out)]
    assert main(argv) == 0
    assert_train_metrics_agree(read_metrics(replay_out / "metrics.jsonl"), live)
