"""Rollout hooks: --rollout-function-path, --eval-function-path, --custom-generate-function-path and the
rollout / eval log hooks, on a RolloutManager whose engine must never be called (fast, no model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.config.backends import BUILTIN_ROLLOUTS
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.sample import COMPLETED, Sample
from miles.rollout import rollout_hooks
from miles.rollout.manager import RolloutManager
from miles.rollout.rollout_hooks import RolloutFnEvalOutput, RolloutFnTrainOutput, RolloutHookError

CALLS: list[tuple[Any, ...]] = []
HERE = __name__


class NoEngine:
    def generate(self, requests: Any) -> Any:
        raise AssertionError("the engine must not be called when a hook replaces it")


def make_manager(tmp_path: Path, **cli: Any) -> RolloutManager:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"digit {d}", "metadata": {"d": d}}) + "\n" for d in range(4)))
    base = {
        "hf_checkpoint": "tiny-sd3",
        "prompt_data": str(prompts),
        "rm_type": "digit",
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "global_batch_size": 4,
        "diffusion_num_sde_steps": 2,
        "actor_num_gpus_per_node": 1,
        "num_gpus_per_node": 1,
        "rollout_backend": "diffusers",
    }
    args = resolve("rl", cli={**base, **cli}).args
    return RolloutManager(args, engines=[NoEngine()])


def done(sample: Sample, reward: float) -> Sample:
    sample.reward, sample.status = reward, COMPLETED
    return sample


# ---- hooks loaded by dotted path from this module -----------------------------------------------------------
def my_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    CALLS.append(("rollout", rollout_id, evaluation))
    if evaluation:
        samples = [done(Sample(index=i, group_index=0, prompt="eval"), 0.5) for i in range(2)]
        return RolloutFnEvalOutput(data={"mine": samples}, metrics={"eval/mine/custom": 7.0})
    groups = data_source.get_samples(args.rollout_batch_size, rollout_id)
    flat = [done(s, float(s.index)) for g in groups for s in g]  # rewards 0, 1 | 2, 3
    return RolloutFnTrainOutput(samples=flat, metrics={"rollout/custom": 1.0})


def bad_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    return {"not": "samples"}


async def my_generate(args: Any, microgroup: list[Sample], sampling_params: dict) -> list[Sample]:
    CALLS.append(("generate", len(microgroup), sampling_params["num_steps"], sampling_params["sde_type"]))
    assert "seeds" not in sampling_params and len(sampling_params["sde_steps"]) == len(microgroup)
    return [
        done(Sample(index=-1, group_index=-1, prompt=s.prompt, seed=s.seed), float(s.seed % 7)) for s in microgroup
    ]


def my_generate_eval(args: Any, microgroup: list[Sample], sampling_params: dict, *, evaluation: bool = False) -> Any:
    CALLS.append(("generate_eval", evaluation))
    return [done(s, 1.0) for s in microgroup]


async def my_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[float]:
    return [0.25 for _ in samples]


def short_generate(args: Any, microgroup: list[Sample], sampling_params: dict) -> list[Sample]:
    return microgroup[:1]


def log_and_skip(rollout_id: int, args: Any, samples: Any, metrics: dict, rollout_time: float) -> bool:
    CALLS.append(("log", rollout_id, len(samples), rollout_time))
    return True


def eval_log_and_skip(rollout_id: int, args: Any, data: dict, extra_metrics: dict) -> bool:
    CALLS.append(("eval_log", rollout_id, sorted(data), sorted(extra_metrics)))
    return True


def eval_log_layer(rollout_id: int, args: Any, data: dict, extra_metrics: dict) -> bool:
    CALLS.append(("eval_log_layer", rollout_id))
    return False


@pytest.fixture(autouse=True)
def _clear() -> None:
    CALLS.clear()


def test_rollout_function_replaces_sampling_and_miles_still_scores(tmp_path: Path) -> None:
    manager = make_manager(tmp_path, rollout_function_path=f"{HERE}.my_rollout")
    batch = manager.generate(3)
    assert CALLS == [("rollout", 3, False)]
    assert [s.reward for s in batch.samples] == [0.0, 1.0, 2.0, 3.0]
    advantages = [s.advantage for s in batch.samples]
    assert advantages[0] < 0 < advantages[1]  # per group
    assert batch.metrics["rollout/custom"] == 1.0 and batch.metrics["rollout/reward/raw_mean"] == 1.5


def test_rollout_function_bad_return_names_the_flag(tmp_path: Path) -> None:
    manager = make_manager(tmp_path, rollout_function_path=f"{HERE}.bad_rollout")
    with pytest.raises(RolloutHookError, match=r"^--rollout-function-path .*bad_rollout.* returned dict"):
        manager.generate(0)


def test_rollout_function_unknown_path_is_one_line(tmp_path: Path) -> None:
    manager = make_manager(tmp_path, rollout_function_path="no_such_pkg.mod.fn")
    with pytest.raises(ConfigError, match=r"^--rollout-function-path 'no_such_pkg.mod.fn': cannot import") as err:
        manager.generate(0)
    assert "\n" not in str(err.value)


def test_builtin_rollout_names_mean_no_hook(tmp_path: Path) -> None:
    for name in BUILTIN_ROLLOUTS:
        args = make_manager(tmp_path, rollout_function_path=name).args
        assert rollout_hooks.rollout_function(args) is None and rollout_hooks.eval_function(args) is None


def test_custom_generate_replaces_the_engine_call(tmp_path: Path) -> None:
    manager = make_manager(tmp_path, custom_generate_function_path=f"{HERE}.my_generate", rollout_microgroup_size=1)
    batch = manager.generate(0)
    assert CALLS == [("generate", 1, 10, "sde")] * 4  # one call per microgroup (4 samples, microgroups of 1)
    assert [s.index for s in batch.samples] == [0, 1, 2, 3]  # planned bookkeeping kept
    assert [s.reward for s in batch.samples] == [float(s.seed % 7) for s in batch.samples]
    assert all(s.advantage is not None for s in batch.samples)


def test_custom_generate_wrong_length_names_the_flag(tmp_path: Path) -> None:
    manager = make_manager(tmp_path, custom_generate_function_path=f"{HERE}.short_generate", rollout_microgroup_size=2)
    with pytest.raises(RolloutHookError, match=r"^--custom-generate-function-path .* expected a list of 2 Sample"):
        manager.generate(0)


def test_custom_generate_gets_evaluation_when_it_takes_it(tmp_path: Path) -> None:
    manager = make_manager(
        tmp_path,
        custom_generate_function_path=f"{HERE}.my_generate_eval",
        eval_prompt_data=[f"t={tmp_path}/p.jsonl"],
        custom_rm_path=f"{HERE}.my_rm",
    )
    metrics, by_name = manager.evaluate()
    assert CALLS and all(call == ("generate_eval", True) for call in CALLS)
    assert metrics["eval/t/reward_mean"] == 0.25 and len(by_name["t"]) == 4  # miles scores eval samples


@pytest.mark.parametrize("dest", ["eval_function_path", "rollout_function_path"])
def test_eval_function_replaces_eval_generation(tmp_path: Path, dest: str) -> None:
    manager = make_manager(tmp_path, **{dest: f"{HERE}.my_rollout"})
    metrics, by_name = manager.evaluate(5)
    assert CALLS == [("rollout", 5, True)]
    assert list(by_name) == ["mine"]
    assert metrics["eval/mine/custom"] == 7.0 and metrics["eval/mine/reward_mean"] == 0.5


def test_rollout_log_hook_truthy_skips_default_logging(tmp_path: Path) -> None:
    args = make_manager(tmp_path, custom_rollout_log_function_path=f"{HERE}.log_and_skip").args
    samples = [Sample(index=0, group_index=0, prompt="p")]
    assert rollout_hooks.log_rollout(args, 4, samples, {"perf/rollout_time": 2.5}) is True
    assert CALLS == [("log", 4, 1, 2.5)]
    assert rollout_hooks.log_rollout(make_manager(tmp_path).args, 4, samples, {}) is False  # unset: default logging


def _fake_ray(monkeypatch: pytest.MonkeyPatch, result: Any) -> Any:
    import types

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda ref: ref))

    class Manager:
        class evaluate:
            @staticmethod
            def remote(rollout_id: int) -> Any:
                CALLS.append(("evaluate", rollout_id))
                return result

    return Manager()


@pytest.mark.parametrize(("hook", "skipped"), [("eval_log_and_skip", True), ("eval_log_layer", False)])
def test_eval_log_hook_in_train_rl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str, skipped: bool) -> None:
    from miles.runtime import eval_job, train_rl

    args = make_manager(tmp_path, custom_eval_rollout_log_function_path=f"{HERE}.{hook}").args
    grids: list[Any] = []
    monkeypatch.setattr(eval_job, "save_eval_grids", lambda *a, **k: grids.append(a))
    samples = {"t": [Sample(index=0, group_index=0, prompt="p", reward=1.0)]}
    manager = _fake_ray(monkeypatch, ({"eval/t/reward_mean": 1.0}, samples))
    metrics = train_rl.run_eval(args, manager, tmp_path, 6)
    assert CALLS[0] == ("evaluate", 6)
    assert (metrics == {}) is skipped and (grids == []) is skipped
    assert CALLS[1] == (("eval_log", 6, ["t"], ["eval/t/reward_mean"]) if skipped else ("eval_log_layer", 6))
