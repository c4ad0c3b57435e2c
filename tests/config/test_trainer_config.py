"""Per-trainer args (seeds/000): the trainer config list and `compute_trainer_args` (fast, torch-free)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
from jobs_helpers import BASE

from miles.config.args import Args
from miles.config.recipes import shipped_recipes
from miles.config.resolve import ResolvedJob, resolve
from miles.config.trainer_config import TrainerConfig, compute_trainer_args, compute_trainer_configs
from miles.core.errors import ConfigError


def run(job: str, **cli: Any) -> ResolvedJob:
    given = {**BASE, **cli}
    if job == "eval":
        given.setdefault("eval_prompt_data", ["digits=test.jsonl"])
    return resolve(job, cli=given, replay_path="rollout_0.pt" if job == "replay" else None)


@pytest.fixture
def args() -> Args:
    """Resolved rl args with mutable values (a list, dicts) to check the copies are deep."""
    return run(
        "rl",
        lora_target_modules="to_q,to_k",
        train_env_vars='{"NCCL_DEBUG": "INFO"}',
        eval_prompt_data=["digits=test.jsonl"],
    ).args


@pytest.mark.parametrize("job", ["rl", "sft", "eval", "rollout-only", "replay"])
def test_the_actor_is_the_only_trainer(job: str) -> None:
    resolved = run(job)
    assert compute_trainer_configs(resolved.args) == [TrainerConfig("actor", {})]
    assert resolved.trainers == [TrainerConfig("actor", {})]
    assert list(resolved.trainer_args) == ["actor"]
    actor = resolved.trainer_args["actor"]
    # The copy holds the same values and sources, so the trainer sees the same arguments.
    assert actor == resolved.args
    assert actor is not resolved.args
    assert actor.sources() == resolved.args.sources()
    assert not any(source.startswith("override:") for source in actor.sources().values())


def test_dmd2_has_a_critic_then_the_actor() -> None:
    resolved = run("dmd2")
    assert [trainer.role for trainer in resolved.trainers] == ["critic", "actor"]
    assert [trainer.role for trainer in compute_trainer_configs(resolved.args)] == ["critic", "actor"]
    critic, actor = resolved.trainers
    assert critic.overrides["loss_type"] == "dmd2_critic"
    assert actor.overrides == {}
    assert resolved.trainer_args["actor"] == resolved.args
    critic_args = resolved.trainer_args["critic"]
    assert (critic_args.loss_type, critic_args.source_of("loss_type")) == ("dmd2_critic", "override:critic")
    assert resolved.args.loss_type == "dmd2"


def test_critic_overrides_keep_only_real_differences() -> None:
    resolved = run("dmd2")
    (critic, _actor) = resolved.trainers
    for dest, value in critic.overrides.items():
        assert getattr(resolved.args, dest) != value, dest


def test_critic_starts_from_the_teacher_and_saves_beside_the_actor() -> None:
    resolved = run("dmd2", teacher_checkpoint="teacher-dir", save="/ckpt/run/", load="/ckpt/old")
    critic = resolved.trainer_args["critic"]
    actor = resolved.trainer_args["actor"]
    assert (critic.hf_checkpoint, actor.hf_checkpoint) == ("teacher-dir", "tiny-sd3")
    assert (critic.save, actor.save) == ("/ckpt/run/critic", "/ckpt/run")  # normalised: no trailing slash
    assert (critic.load, actor.load) == ("/ckpt/old/critic", "/ckpt/old")
    for dest in ("hf_checkpoint", "save", "load"):
        assert critic.source_of(dest) == "override:critic"
        assert actor.source_of(dest) == "cli"


def test_trainer_args_are_a_deep_copy_with_overrides(args: Args) -> None:
    values_before = copy.deepcopy(args.to_dict())
    sources_before = args.sources()
    modules = ["to_q", "to_k", "to_v"]
    trainer = TrainerConfig("critic", {"lr": 2e-6, "lora_target_modules": modules})

    out = compute_trainer_args(args, trainer)

    assert out is not args
    assert out.lr == 2e-6
    assert out.lora_target_modules == ["to_q", "to_k", "to_v"]
    assert out.source_of("lr") == "override:critic"
    assert out.source_of("lora_target_modules") == "override:critic"
    # Everything else is the input's value and source.
    for dest in args:
        if dest not in trainer.overrides:
            assert getattr(out, dest) == getattr(args, dest), dest
            assert out.source_of(dest) == args.source_of(dest), dest

    # Mutating the copy's lists and dicts leaves the input untouched...
    out.lora_target_modules.append("to_out")
    out.train_env_vars["EXTRA"] = "1"
    out.eval_prompt_data["other"] = "x.jsonl"
    out.custom["key"] = "value"
    out.sglang_args["attention_backend"] = "fa3"
    out.lr = 1.0
    # ... and so does mutating the override values after the fact.
    modules.append("proj")
    assert out.lora_target_modules == ["to_q", "to_k", "to_v", "to_out"]

    assert args.to_dict() == values_before
    assert args.sources() == sources_before
    assert args.lora_target_modules == ["to_q", "to_k"]
    assert args.train_env_vars == {"NCCL_DEBUG": "INFO"}
    assert args.custom == {}


def test_no_overrides_gives_an_equal_copy(args: Args) -> None:
    out = compute_trainer_args(args, TrainerConfig("actor", {}))
    assert out == args
    assert out is not args
    out.lora_target_modules.append("to_out")
    assert args.lora_target_modules == ["to_q", "to_k"]


def test_unknown_override_is_rejected(args: Args) -> None:
    before = args.to_dict()
    with pytest.raises(ConfigError) as excinfo:
        compute_trainer_args(args, TrainerConfig("critic", {"lrr": 1e-5, "lr": 1e-5}))
    message = str(excinfo.value)
    assert "'critic'" in message
    assert "'lrr'" in message
    assert "did you mean 'lr'" in message
    assert args.to_dict() == before


def test_args_reject_unknown_attributes(args: Args) -> None:
    with pytest.raises(AttributeError):
        _ = args.no_such_argument
    with pytest.raises(AttributeError):
        args.no_such_argument = 1


def _all_resolved_args() -> list[tuple[str, Args]]:
    found: list[tuple[str, Args]] = []
    for name in shipped_recipes():
        resolved = resolve(None, recipe=name)
        found.append((name, resolved.args))
        found += [(f"{name}:{role}", trainer_args) for role, trainer_args in resolved.trainer_args.items()]
    return found


def test_deep_copy_pickles_to_the_same_bytes() -> None:
    cases = [*_all_resolved_args(), ("rl+lists", run("rl", lora_target_modules="to_q,to_k").args)]
    for label, original in cases:
        clone = copy.deepcopy(original)
        # Byte equality holds because the copy keeps the insertion order of every dict
        # (values, sources, trainer overrides) and shares the interned source strings.
        assert pickle.dumps(clone) == pickle.dumps(original), label
        restored = pickle.loads(pickle.dumps(original))
        assert restored == original, label
        assert restored.job == original.job
        assert restored.trainer_overrides == original.trainer_overrides
