"""The reward-hacking guard's decisions, the diversity it watches, its runner in the job's loop (a recording trainer
group) and its config rules (fast; the guard acting inside a real job is tests/e2e/test_reward_guard_e2e.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.rollout.diversity import group_diversity, intra_group_diversity, pooled
from miles.runtime.reward_guard import BEST_DIR, BEST_STEP, GuardRunner, RewardGuard, gold_of, ratio_bias_of


def evals(guard: RewardGuard, golds: list[float]) -> list[tuple[bool, str]]:
    out = []
    for rollout_id, gold in enumerate(golds):
        metrics, new_best, why = guard.observe_eval(rollout_id, {"eval/a/gold_reward_mean": gold})
        assert metrics["guard/gold_reward"] == gold
        out.append((new_best, why))
    return out


def test_patience_and_tolerance() -> None:
    guard = RewardGuard("stop", patience=2, tolerance=0.05, min_diversity=None)
    seen = evals(guard, [0.5, 0.6, 0.58, 0.54, 0.59, 0.53, 0.52, 0.5])
    assert [best for best, _ in seen] == [True, True, False, False, False, False, False, False]
    # 0.58 is within the tolerance; 0.54 counts; 0.59 resets; 0.53 and 0.52 are two in a row: triggered, once
    assert [bool(why) for _, why in seen] == [False] * 6 + [True, False]
    assert "fell to 0.5200 from its best 0.6000 (at rollout 1) for 2 evaluations in a row" in seen[-2][1]
    assert guard.state.best_rollout == 1 and guard.state.triggered


def test_a_guard_that_is_off_only_logs() -> None:
    guard = RewardGuard("off", patience=1, tolerance=0.0, min_diversity=0.5)
    assert [why for _, why in evals(guard, [0.5, 0.1, 0.1])] == ["", "", ""]
    assert guard.observe_rollout({"rollout/diversity": 0.2})[1] == ""
    assert guard.observe_rollout({"rollout/diversity": 0.01})[0]["guard/diversity"] == pytest.approx(0.05)
    assert not guard.state.triggered


def test_diversity_falls_below_a_fraction_of_the_first_rollouts() -> None:
    guard = RewardGuard("warn", patience=5, tolerance=0.0, min_diversity=0.5)
    assert guard.observe_rollout({"rollout/diversity": 0.3, "train/ratio_mean": 0.98})[0] == {
        "guard/diversity": 1.0,
        "guard/ratio_bias": pytest.approx(0.02),
    }
    assert guard.observe_rollout({"rollout/diversity": 0.16})[1] == ""
    why = guard.observe_rollout({"rollout/diversity": 0.12})[1]
    assert "diversity fell to 0.400 of the first rollout's (--reward-guard-min-diversity 0.5)" in why
    assert guard.observe_rollout({"rollout/diversity": 0.1})[1] == ""  # said once while it stays low
    assert guard.observe_rollout({"rollout/diversity": 0.2})[1] == ""
    assert guard.observe_rollout({"rollout/diversity": 0.1})[1]  # and again after a recovery


def test_the_guard_state_survives_a_resume() -> None:
    guard = RewardGuard("rollback", patience=2, tolerance=0.0, min_diversity=None)
    evals(guard, [0.5, 0.7, 0.6])
    again = RewardGuard("rollback", patience=2, tolerance=0.0, min_diversity=None)
    again.load_state_dict(guard.state_dict())
    _, new_best, why = again.observe_eval(3, {"eval/a/gold_reward_mean": 0.6})
    assert not new_best and "for 2 evaluations in a row" in why and again.state.best_rollout == 1


def test_the_signals_read_from_the_metrics() -> None:
    metrics = {"eval/a/gold_reward_mean": 0.2, "eval/b/gold_reward_mean": 0.4, "eval/a/reward_mean": 9}
    assert gold_of(metrics) == pytest.approx(0.3)
    assert gold_of({"eval/a/reward_mean": 0.2}) is None
    assert ratio_bias_of({"train/ratio_bias": 1e-3, "train/ratio_mean": 0.9}) == 1e-3  # GRPO-Guard's, when logged
    assert ratio_bias_of({"train/ratio_mean": 0.99}) == pytest.approx(0.01)
    assert ratio_bias_of({}) is None


# ---- diversity ----------------------------------------------------------------------------------


def test_diversity_of_identical_and_of_opposite_images() -> None:
    black, white = torch.zeros(3, 8, 8), torch.ones(3, 8, 8)
    assert group_diversity([black, black, black]) == 0.0
    assert group_diversity([black, white]) == pytest.approx(1.0)
    assert group_diversity([black, white, white]) == pytest.approx(2 / 3)  # pairs: 1, 1, 0 (each counted twice)
    assert group_diversity([black]) is None


def test_diversity_pools_large_images_and_reads_videos_per_frame() -> None:
    big = torch.rand(3, 256, 128)
    assert pooled(big).shape == (3 * 64 * 64,)
    video = torch.rand(3, 5, 32, 32)
    assert pooled(video).shape == (5 * 3 * 32 * 32,)
    g = torch.Generator().manual_seed(0)
    noisy = [torch.rand(3, 512, 512, generator=g) for _ in range(3)]
    small = [torch.rand(3, 64, 64, generator=g) for _ in range(3)]
    assert group_diversity(noisy) < 0.06 < 0.35 < group_diversity(small)  # 8x8 pooling averages pixel noise out


class _S:
    def __init__(self, image: torch.Tensor) -> None:
        self.image = image


def test_intra_group_diversity_averages_the_groups() -> None:
    black, white = torch.zeros(3, 4, 4), torch.ones(3, 4, 4)
    groups = [[_S(black), _S(white)], [_S(black), _S(black)], [_S(white)]]
    assert intra_group_diversity(groups) == pytest.approx(0.5)  # 1 and 0; a single sample has none
    assert intra_group_diversity([[_S(black)]]) is None


# ---- the runner inside the job's loop ---------------------------------------------------------


class _Group:
    """A trainer group that records what the runner asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call(self, method: str, *args) -> None:
        self.calls.append((method, *args))
        if method == "save_checkpoint":
            Path(args[0]).mkdir(parents=True, exist_ok=True)


def _run_evals(policy: str, out: Path) -> tuple[_Group, list[bool], list[str]]:
    """The e2e script (tests/e2e/test_reward_guard_e2e.py): gold 0.9, 0.5, 0.4 at rollouts 0-2, patience 2."""
    runner = GuardRunner(RewardGuard(policy, patience=2, tolerance=0.0, min_diversity=None), out)
    group, synced, ended = _Group(), [], []
    for rollout_id, gold in enumerate([0.9, 0.5, 0.4]):
        runner.after_eval(rollout_id, {"eval/digits/gold_reward_mean": gold}, group, contextlib.nullcontext)
        ended.append(runner.ended)
    runner.restore_best(group, lambda: synced.append("sync"), contextlib.nullcontext)
    return group, ended, synced


def test_the_runner_under_stop_ends_the_loop_and_keeps_the_weights_it_has(tmp_path: Path, capsys) -> None:
    """`stop` in the job's loop: the line, the loop ends at the trigger, no best checkpoint is saved and nothing is
    restored before the export (the job run under `stop` is an `extended` test of
    tests/e2e/test_reward_guard_e2e.py; the loop ending and exporting under the guard runs there under
    `rollback` in the default suite)."""
    group, ended, synced = _run_evals("stop", tmp_path)
    said = capsys.readouterr().out
    assert ended == [False, False, True]
    assert "miles: warning: reward guard (stop): the gold reward fell to 0.4000 from its best 0.9000" in said
    assert "the job ends here" in said and "restored" not in said
    assert group.calls == [] and synced == []  # the weights it has: no best saved, none loaded, no sync
    assert not (tmp_path / "reward_guard").exists()


def test_the_runner_under_rollback_saves_each_best_and_restores_it(tmp_path: Path, capsys) -> None:
    """The contrast of the test above, on the same script: rollback saves the best (rollout 0's start point) and
    loads it back, then syncs the engines."""
    group, ended, synced = _run_evals("rollback", tmp_path)
    assert ended == [False, False, True]
    best = str(tmp_path / BEST_DIR)
    assert group.calls == [
        ("save_checkpoint", best, BEST_STEP, {"rollout_id": -1}),
        ("load_checkpoint", best, BEST_STEP),
    ]
    assert synced == ["sync"]
    assert "restored the weights of the best gold reward 0.9000 (evaluated at rollout 0)" in capsys.readouterr().out


# ---- rules --------------------------------------------------------------------------------------


def job(**cli):
    return resolve("rl", recipe="tiny-digits-grpo", cli=cli)


def test_the_guards_rules() -> None:
    eval_data = {"eval_interval": 2}  # the recipe has eval data
    ok = job(gold_rm_type="digit", reward_guard="rollback", **eval_data)
    assert ok.args.reward_guard == "rollback" and ok.args.gold_rm_type == "digit"
    assert job(gold_rm_type="my_rewards.gold").args.gold_rm_type == "my_rewards.gold"
    with pytest.raises(ConfigError, match="acts on a held-out gold reward: set --gold-rm-type"):
        job(reward_guard="stop", **eval_data)
    with pytest.raises(ConfigError, match="set --eval-interval N"):
        job(reward_guard="stop", gold_rm_type="digit")
    with pytest.raises(ConfigError, match="not a built-in reward type"):
        job(gold_rm_type="remote_rm")
    with pytest.raises(ConfigError, match="tunes the reward guard, which --reward-guard off"):
        job(reward_guard_patience=3)
    with pytest.raises(ConfigError, match="is scored on the evaluation samples"):
        resolve(
            "rl",
            cli={
                "hf_checkpoint": "tiny-sd3",
                "prompt_data": "p.jsonl",
                "rm_type": "digit",
                "rollout_batch_size": 8,
                "n_samples_per_prompt": 4,
                "diffusion_num_sde_steps": 2,
                "actor_num_gpus_per_node": 1,
                "num_gpus_per_node": 1,
                "gold_rm_type": "digit",
            },
        )


def test_tolerance_and_min_diversity_reach_the_guard() -> None:
    args = job(
        gold_rm_type="digit",
        reward_guard="warn",
        eval_interval=1,
        reward_guard_tolerance=0.1,
        reward_guard_min_diversity=0.5,
    ).args
    guard = RewardGuard.from_args(args)
    assert guard is not None and (guard.policy, guard.tolerance, guard.min_diversity) == ("warn", 0.1, 0.5)
    assert [why for _, why in evals(guard, [0.5, 0.45, 0.45, 0.45])] == ["", "", "", ""]  # within 0.1 of the best
    guard.observe_rollout({"rollout/diversity": 0.4})
    assert "diversity fell to 0.250" in guard.observe_rollout({"rollout/diversity": 0.1})[1]
    assert RewardGuard.from_args(job().args) is None  # no gold reward and no guard: nothing runs
