"""Layering: defaults < recipe < command line < --custom-config-path YAML, with the source of each value."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from miles.config.resolve import ResolvedJob, resolve
from miles.core.errors import ConfigError

RECIPE = """\
job: rl
description: a test recipe
hf_checkpoint: tiny-sd3
prompt_data: p.jsonl
rm_type: digit
rollout_batch_size: 8
n_samples_per_prompt: 4
diffusion_num_sde_steps: 2
actor_num_gpus_per_node: 1
num_gpus_per_node: 1
lr: 2.0e-4
seed: 11
rollout_seed: 12
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def recipe(tmp_path: Path) -> str:
    return str(write(tmp_path / "my-recipe.yaml", RECIPE))


def with_yaml(path: Path, text: str, **cli: Any) -> dict[str, Any]:
    write(path, text)
    return {**cli, "custom_config_path": str(path)}


def rejected(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as excinfo:
        resolve(*args, **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---- precedence --------------------------------------------------------------------------


def test_each_layer_wins_over_the_one_below(tmp_path: Path, recipe: str) -> None:
    # lr: recipe < cli < yaml; seed: recipe < cli; rollout_seed: recipe; adam_eps: default.
    cli = with_yaml(tmp_path / "c.yaml", "lr: 5.0e-4\n", lr="3e-4", seed="13")
    args = resolve("rl", cli=cli, recipe=recipe).args
    assert (args.lr, args.source_of("lr")) == (5e-4, "yaml")
    assert (args.seed, args.source_of("seed")) == (13, "cli")
    assert (args.rollout_seed, args.source_of("rollout_seed")) == (12, "recipe")
    assert (args.adam_eps, args.source_of("adam_eps")) == (1e-8, "default")
    assert args.source_of("global_batch_size") == "derived"


def test_cli_over_recipe_and_default(recipe: str) -> None:
    args = resolve("rl", cli={"lr": "3e-4", "weight_decay": "0.1"}, recipe=recipe).args
    assert (args.lr, args.source_of("lr")) == (3e-4, "cli")
    assert (args.weight_decay, args.source_of("weight_decay")) == (0.1, "cli")


def test_yaml_over_recipe_without_cli(tmp_path: Path, recipe: str) -> None:
    resolved = resolve("rl", cli=with_yaml(tmp_path / "c.yaml", "rollout_seed: 99\n"), recipe=recipe)
    assert (resolved.args.rollout_seed, resolved.args.source_of("rollout_seed")) == (99, "yaml")
    # The YAML overriding a recipe value warns too.
    assert len(resolved.warnings) == 1
    assert "rollout_seed" in resolved.warnings[0]


def test_job_comes_from_the_recipe_or_the_yaml(tmp_path: Path, recipe: str) -> None:
    assert resolve(None, recipe=recipe).spec.name == "rl"
    assert resolve(None, cli=with_yaml(tmp_path / "c.yaml", RECIPE)).spec.name == "rl"
    assert "which job" in rejected(None, cli={"hf_checkpoint": "tiny-sd3"})


def test_yaml_overriding_cli_warns_once_per_key(tmp_path: Path, recipe: str) -> None:
    path = tmp_path / "override.yaml"
    cli = with_yaml(path, "lr: 5.0e-4\nseed: 7\nrollout_seed: 12\nweight_decay: 0.0\n", lr="3e-4", seed="13")
    resolved = resolve("rl", cli=cli, recipe=recipe)
    # lr and seed change a value the command line set; rollout_seed repeats the recipe's value and
    # weight_decay only repeats a default: no warning for those.
    assert len(resolved.warnings) == 2
    by_key = {key: [w for w in resolved.warnings if f"key {key!r}" in w] for key in ("lr", "seed")}
    assert all(len(found) == 1 for found in by_key.values()), resolved.warnings
    for key, (warning,) in by_key.items():
        assert str(path) in warning
        assert f"--{key}" in warning
    assert "--lr 0.0003 (cli)" in by_key["lr"][0]
    assert "--seed 13 (cli)" in by_key["seed"][0]


# ---- unknown keys and bad YAML -------------------------------------------------------------------


def test_unknown_key_in_a_recipe(tmp_path: Path) -> None:
    path = write(tmp_path / "bad-recipe.yaml", RECIPE + "rollout_batchsize: 4\n")
    message = rejected("rl", recipe=str(path))
    assert str(path) in message
    assert "'rollout_batchsize'" in message
    assert "did you mean 'rollout_batch_size'" in message
    # The line of the key.
    assert f":{RECIPE.count(chr(10)) + 1}:" in message


def test_unknown_key_in_a_yaml(tmp_path: Path, recipe: str) -> None:
    path = tmp_path / "c.yaml"
    message = rejected("rl", recipe=recipe, cli=with_yaml(path, "lr: 1.0e-4\nglobal_batch_sise: 16\n"))
    assert f"{path}:2" in message
    assert "'global_batch_sise'" in message
    assert "did you mean 'global_batch_size'" in message


def test_unknown_key_with_dashes_suggests_the_flag(tmp_path: Path, recipe: str) -> None:
    message = rejected("rl", recipe=recipe, cli=with_yaml(tmp_path / "c.yaml", "n-samples-per-promt: 2\n"))
    assert "n-samples-per-promt" in message
    assert "n_samples_per_prompt" in message


def test_yaml_keys_may_use_dashes_or_aliases(tmp_path: Path, recipe: str) -> None:
    cli = with_yaml(tmp_path / "c.yaml", "rollout-seed: 3\n")
    assert resolve("rl", recipe=recipe, cli=cli).args.rollout_seed == 3


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("lr: 1.0e-4\n  seed: 2\n", 2),
        ("lr: 1.0e-4\nseed: 2\ncustom: {a: [1, 2}\n", 3),
    ],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path: Path, recipe: str, text: str, line: int) -> None:
    path = tmp_path / "broken.yaml"
    message = rejected("rl", recipe=recipe, cli=with_yaml(path, text))
    assert f"{path}:{line}:" in message
    assert "invalid YAML" in message


def test_bad_value_in_a_yaml_names_file_and_key(tmp_path: Path, recipe: str) -> None:
    path = tmp_path / "c.yaml"
    message = rejected("rl", recipe=recipe, cli=with_yaml(path, "lr: 1.0e-4\nrollout_batch_size: many\n"))
    assert f"{path}:2: key 'rollout_batch_size'" in message
    assert "'many'" in message


def test_top_level_yaml_must_be_a_mapping(tmp_path: Path, recipe: str) -> None:
    path = tmp_path / "c.yaml"
    message = rejected("rl", recipe=recipe, cli=with_yaml(path, "- lr\n- seed\n"))
    assert str(path) in message


def test_missing_yaml_file(tmp_path: Path, recipe: str) -> None:
    path = tmp_path / "nope.yaml"
    message = rejected("rl", recipe=recipe, cli={"custom_config_path": str(path)})
    assert str(path) in message


# ---- custom: and the sglang passthrough -------------------------------------------------------------


def test_custom_mapping_passes_through_untouched(tmp_path: Path, recipe: str) -> None:
    text = "custom:\n  reward_scale: 0.5\n  nested: {items: [1, two, {three: 3}], flag: true}\n  none: null\n"
    args = resolve("rl", recipe=recipe, cli=with_yaml(tmp_path / "c.yaml", text)).args
    assert args.custom == {
        "reward_scale": 0.5,
        "nested": {"items": [1, "two", {"three": 3}], "flag": True},
        "none": None,
    }
    assert args.source_of("custom") == "yaml"


def test_custom_mapping_defaults_to_empty(recipe: str) -> None:
    args = resolve("rl", recipe=recipe).args
    assert args.custom == {}
    assert args.sglang_args == {}


def test_custom_must_be_a_mapping(tmp_path: Path, recipe: str) -> None:
    message = rejected("rl", recipe=recipe, cli=with_yaml(tmp_path / "c.yaml", "custom: [1, 2]\n"))
    assert "'custom'" in message


def test_sglang_passthrough(recipe: str) -> None:
    args = resolve("rl", recipe=recipe, sglang={"attention_backend": "fa3", "enable_torch_compile": "true"}).args
    assert args.sglang_args == {"attention_backend": "fa3", "enable_torch_compile": "true"}
    assert args.source_of("sglang_args") == "cli"


def test_sglang_keys_in_a_recipe(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yaml", RECIPE + "sglang_attention_backend: fa3\nsglang_args:\n  cpu_offload: true\n")
    args = resolve("rl", recipe=str(path)).args
    assert args.sglang_args == {"attention_backend": "fa3", "cpu_offload": True}
    assert args.source_of("sglang_args") == "recipe"


@pytest.mark.parametrize("key", ["port", "host", "model_path", "base_gpu_id", "random_seed"])
def test_sglang_keys_miles_owns_are_refused(recipe: str, key: str) -> None:
    message = rejected("rl", recipe=recipe, sglang={key: "1"})
    assert f"--sglang-{key.replace('_', '-')}" in message


def test_sglang_port_in_a_yaml_is_refused(tmp_path: Path, recipe: str) -> None:
    message = rejected("rl", recipe=recipe, cli=with_yaml(tmp_path / "c.yaml", "sglang_port: 3000\n"))
    assert "--sglang-port" in message


# ---- recipes and jobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job", "recipe_name", "recipe_job"),
    [
        ("dmd2", "tiny-digits-grpo", "train rl"),
        ("sft", "sd35-4step", "train dmd2"),
        ("rl", "tiny-digits-sft", "train sft"),
        ("rl", "tiny-digits-4step", "train dmd2"),
    ],
)
def test_training_recipe_under_another_training_job_is_rejected(job: str, recipe_name: str, recipe_job: str) -> None:
    message = rejected(job, recipe=recipe_name)
    assert f"recipe {recipe_name}" in message
    assert f"`miles {recipe_job}`" in message
    assert f"`miles train {job}`" in message


def test_training_yaml_under_another_training_job_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", RECIPE)
    message = rejected("sft", cli={"custom_config_path": str(path)})
    assert str(path) in message
    assert "`miles train rl`" in message


# Extra flags each recipe needs to run as eval / rollout-only (the checks of those jobs still apply).
_REUSE_EXTRA: dict[str, dict[str, Any]] = {
    "sd35-4step": {"rm_type": "digit"},
    "tiny-digits-sft": {"rollout_batch_size": 64},
}


@pytest.mark.parametrize("job", ["eval", "rollout-only"])
@pytest.mark.parametrize(
    "recipe_name",
    ["sd3-ocr-grpo", "sd3-pickscore-nft", "sd35-4step", "tiny-digits-4step", "tiny-digits-grpo", "tiny-digits-sft"],
)
def test_eval_and_rollout_only_accept_any_recipe(job: str, recipe_name: str) -> None:
    cli = {"eval_prompt_data": ["test=test.jsonl"], **_REUSE_EXTRA.get(recipe_name, {})}
    resolved = resolve(job, cli=cli, recipe=recipe_name)
    assert resolved.spec.name == job
    # Another job's `trainers:` do not apply: eval and rollout-only have the actor only.
    assert [t.role for t in resolved.trainers] == ["actor"]
    assert resolved.trainers[0].overrides == {}
    assert resolved.args.eval_prompt_data == {"test": os.path.abspath("test.jsonl")}


# ---- per-trainer overrides ------------------------------------------------------------------------------------------


def _dmd2(overrides: list[str]) -> ResolvedJob:
    return resolve("dmd2", recipe="tiny-digits-4step", overrides=overrides)


def test_override_lands_in_the_critic_only() -> None:
    resolved = _dmd2(["critic.lr=5e-6", "critic.weight_decay=0.1"])
    critic, actor = resolved.trainer_args["critic"], resolved.trainer_args["actor"]
    assert (critic.lr, critic.source_of("lr")) == (5e-6, "override:critic")
    assert (critic.weight_decay, critic.source_of("weight_decay")) == (0.1, "override:critic")
    assert (actor.lr, actor.source_of("lr")) == (1e-4, "recipe")
    assert actor.source_of("weight_decay") == "default"
    # The job-level args are the actor's.
    assert resolved.args.lr == 1e-4


def test_override_beats_the_recipes_trainers_section() -> None:
    # tiny-digits-4step sets trainers.critic.lr: 2.0e-4.
    assert _dmd2([]).trainer_args["critic"].lr == 2e-4
    assert _dmd2(["critic.lr=5e-6"]).trainer_args["critic"].lr == 5e-6


def test_override_accepts_dashes_in_the_key() -> None:
    critic = _dmd2(["critic.weight-decay=0.2"]).trainer_args["critic"]
    assert critic.weight_decay == 0.2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("judge.lr=1e-5", ["'judge'", "critic, actor"]),
        ("critic.lrr=1e-5", ["'lrr'", "did you mean 'lr'"]),
        ("critic.lr=fast", ["critic.lr=fast", "'fast'"]),
        ("critic.lr", ["ROLE.KEY=VALUE"]),
        ("lr=1e-5", ["ROLE.KEY=VALUE"]),
        ("actor.lr=1e-5", ["--lr"]),
        ("critic.loss_type=dmd2", ["dmd2_critic"]),
    ],
)
def test_bad_overrides_are_rejected(text: str, expected: list[str]) -> None:
    message = rejected("dmd2", recipe="tiny-digits-4step", overrides=[text])
    for part in expected:
        assert part in message


def test_override_under_a_job_without_a_critic_is_rejected(recipe: str) -> None:
    message = rejected("rl", recipe=recipe, overrides=["critic.lr=1e-5"])
    assert "'critic'" in message
    assert "actor" in message


def test_trainers_section_in_a_yaml(tmp_path: Path) -> None:
    cli = with_yaml(tmp_path / "c.yaml", "trainers:\n  critic:\n    lr: 3.0e-6\n")
    critic = resolve("dmd2", recipe="tiny-digits-4step", cli=cli).trainer_args["critic"]
    assert (critic.lr, critic.source_of("lr")) == (3e-6, "override:critic")


def test_unknown_key_in_a_trainers_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    message = rejected(
        "dmd2", recipe="tiny-digits-4step", cli=with_yaml(path, "trainers:\n  critic:\n    learning_rat: 3.0e-6\n")
    )
    assert str(path) in message
    assert "learning_rat" in message


def test_the_resolution_keeps_what_each_layer_set() -> None:
    """`Resolution.value_at`: a flag's value as the given layers left it (the grid a recipe chose its step indices
    on, before the command line changed it); the default where none of them set it."""
    from miles.config.resolution import Resolution

    res = Resolution("rl")
    res.set("diffusion_num_steps", 16, "recipe")
    res.set("diffusion_num_steps", 35, "cli")
    res.derive("diffusion_num_steps", 36)  # a rule's value is no layer's
    assert res.value_at("diffusion_num_steps", ("default", "recipe")) == 16
    assert res.value_at("diffusion_num_steps", ("default", "recipe", "cli")) == 35
    assert res.value_at("diffusion_num_steps", ("default",)) == 10  # the flag's default
    assert res.value_at("diffusion_flow_shift", ("default", "recipe", "cli")) is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("custom: &a {b: *a}\n", ":1: a YAML alias (*x) refers to the mapping or list that contains it"),
        ("lr: 1.0e-4\ncustom: &a [1, *a]\n", ":2: a YAML alias (*x) refers to the mapping or list that contains it"),
        ("custom: " + "[" * 100 + "]" * 100 + "\n", ":1: nested deeper than 64 levels"),
        pytest.param(  # over a second (PyYAML scans the 10,000 brackets): not in the fast tier
            "custom: " + "[" * 5000 + "]" * 5000 + "\n", ": nested deeper than 64 levels", marks=pytest.mark.slow
        ),
    ],
)
def test_yaml_alias_cycles_and_deep_nesting_are_one_line(
    tmp_path: Path, recipe: str, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value that would be infinite (an alias inside what it names) or nests past any config's need (PyYAML
    composes recursively: thousands of levels would end in a RecursionError) is a usage error naming the file."""
    from miles_cli.main import main

    path = tmp_path / "c.yaml"
    assert f"{path}{said}" in rejected("rl", recipe=recipe, cli=with_yaml(path, text))
    capsys.readouterr()
    assert main(["inspect-config", "--recipe", recipe, "--custom-config-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err.splitlines()[0]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
