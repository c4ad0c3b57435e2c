"""Values and YAML files that cannot be right (torch-free): NaN and infinity in a float flag, a YAML null where a
number is required, and a mapping key given twice. Each is one line naming the source (flag, file:line:key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs_helpers import BASE, DROP, rejected, run

from miles.config.catalog import ALL_FLAGS, flag_for
from miles.config.flags import FLOAT, Flag
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.rollout.evaluation import eval_datasets
from miles_cli.main import main

RECIPE_HEAD = "job: rl\nhf_checkpoint: tiny-sd3\nprompt_data: p.jsonl\nrm_type: digit\nrollout_batch_size: 8\n"
RECIPE_TAIL = "n_samples_per_prompt: 4\ndiffusion_num_sde_steps: 2\nactor_num_gpus_per_node: 1\nnum_gpus_per_node: 1\n"


def refused(**kwargs: Any) -> str:
    with pytest.raises(ConfigError) as excinfo:
        resolve("rl", **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message, "a ConfigError is one line"
    return message


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ---- NaN and infinity --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [("nan", "nan is not a number"), ("NaN", "NaN is not a number"), ("inf", "inf is infinite"),
     ("-inf", "-inf is infinite"), ("1e999", "1e999 overflows to infinity"), (float("nan"), "nan is not a number"),
     (float("-inf"), "-inf is infinite")],
)  # fmt: skip
@pytest.mark.parametrize("dest", ["lr", "diffusion_guidance_scale", "diffusion_clip_range"])
def test_nan_and_inf_on_the_command_line_are_refused(dest: str, raw: Any, shown: str) -> None:
    option = f"--{dest.replace('_', '-')}"
    assert rejected(**{dest: raw}) == f"{option}: {shown}; expected a finite number"


@pytest.mark.parametrize(("text", "shown"), [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("NaN", "NaN")])
@pytest.mark.parametrize("dest", ["lr", "diffusion_guidance_scale", "diffusion_clip_range"])
def test_nan_and_inf_in_a_recipe_name_file_line_and_key(tmp_path: Path, dest: str, text: str, shown: str) -> None:
    recipe = write(tmp_path / "recipe.yaml", f"{RECIPE_HEAD}{dest}: {text}\n{RECIPE_TAIL}")
    what = "is not a number" if "nan" in shown.lower() else "is infinite"
    assert refused(recipe=recipe) == f"{recipe}:6: key {dest!r}: {shown} {what}; expected a finite number"


@pytest.mark.parametrize("dest", ["lr", "diffusion_guidance_scale", "diffusion_clip_range"])
def test_nan_in_a_custom_yaml_and_in_a_json_file(tmp_path: Path, dest: str) -> None:
    custom = write(tmp_path / "custom.yaml", f"seed: 3\n{dest}: .nan\n")
    assert refused(cli={**BASE, "custom_config_path": custom}) == (
        f"{custom}:2: key {dest!r}: nan is not a number; expected a finite number"
    )
    as_json = write(tmp_path / "custom.json", f'{{"seed": 3,\n "{dest}": -Infinity}}\n')
    assert f"{as_json}:2: key {dest!r}: expected a number, got '-Infinity'" in refused(
        cli={**BASE, "custom_config_path": as_json}
    )


def test_nan_in_a_trainer_override_is_refused(tmp_path: Path) -> None:
    dmd2 = {"recipe": "tiny-digits-4step"}
    with pytest.raises(ConfigError, match=r"^--override critic\.lr=nan: nan is not a number; expected a finite"):
        resolve("dmd2", overrides=["critic.lr=nan"], **dmd2)
    custom = write(tmp_path / "c.yaml", "trainers:\n  critic:\n    lr: .inf\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: key 'trainers': critic\.lr: inf is infinite"):
        resolve("dmd2", cli={"custom_config_path": custom}, **dmd2)


def test_the_cli_refuses_nan_as_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect-config", "--recipe", "tiny-digits-grpo", "--lr", "nan"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["miles: error: --lr: nan is not a number; expected a finite number"]


def test_every_float_flag_refuses_nan_and_inf() -> None:
    floats = [flag for flag in ALL_FLAGS if flag.kind == FLOAT]
    assert len(floats) > 30
    for flag in floats:
        assert not flag.allow_inf, f"{flag.option}: the CLI reference gives infinity no meaning"
        for raw in ("nan", "inf", "-inf", float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=rf"^{flag.option}: "):
                flag.parse(raw, flag.option)


def test_allow_inf_lets_infinity_through_but_never_nan() -> None:
    limit = Flag("some-limit", FLOAT, default=10.0, min=0, allow_inf=True)
    assert limit.parse("inf", "--some-limit") == float("inf")
    assert limit.parse(float("inf"), "--some-limit") == float("inf")
    with pytest.raises(ConfigError, match=r"^--some-limit: nan is not a number; expected a number \(inf is allowed\)"):
        limit.parse("nan", "--some-limit")
    with pytest.raises(ConfigError, match="below the minimum 0"):
        limit.parse("-inf", "--some-limit")


def test_finite_values_still_parse() -> None:
    lr = flag_for("lr")
    assert lr is not None
    assert [lr.parse(raw, "--lr") for raw in ("1e-5", 2e-4, 3, "0")] == [1e-5, 2e-4, 3.0, 0.0]


# ---- YAML null where a number is required --------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", " null", " ~"])
def test_null_for_a_number_with_a_default_is_refused(tmp_path: Path, text: str) -> None:
    custom = write(tmp_path / "custom.yaml", f"seed: 3\nlr:{text}\n")
    assert refused(cli={**BASE, "custom_config_path": custom}) == (
        f"{custom}:2: key 'lr': expected a number, got null; remove the key to keep the default 1e-06"
    )
    recipe = write(tmp_path / "recipe.yaml", f"{RECIPE_HEAD}diffusion_guidance_scale:{text}\n{RECIPE_TAIL}")
    assert refused(recipe=recipe) == (
        f"{recipe}:6: key 'diffusion_guidance_scale': expected a number, got null; "
        "remove the key to keep the default 4.0"
    )


def test_null_for_an_integer_with_a_default_is_refused(tmp_path: Path) -> None:
    custom = write(tmp_path / "custom.yaml", "seed:\n")
    assert "key 'seed': expected a number, got null; remove the key to keep the default" in refused(
        cli={**BASE, "custom_config_path": custom}
    )


def test_null_keeps_meaning_unset_for_a_number_without_a_default(tmp_path: Path) -> None:
    custom = write(tmp_path / "custom.yaml", "lr_warmup_fraction: null\ndiffusion_guidance_scale_2: ~\n")
    args = run(custom_config_path=custom).args
    assert args.lr_warmup_fraction is None and args.diffusion_guidance_scale_2 is None


# ---- duplicate keys ------------------------------------------------------------------------------------------


def test_a_top_level_key_given_twice_names_both_lines(tmp_path: Path) -> None:
    custom = write(tmp_path / "my.yaml", "seed: 3\nlr: 1.0e-5\n# a comment\nlr: 2.0e-5\n")
    assert (
        refused(cli={**BASE, "custom_config_path": custom}) == f"{custom}:4: key 'lr' is given twice (first at line 2)"
    )
    recipe = write(tmp_path / "recipe.yaml", f"{RECIPE_HEAD}{RECIPE_TAIL}rollout_batch_size: 16\n")
    assert refused(recipe=recipe) == f"{recipe}:10: key 'rollout_batch_size' is given twice (first at line 5)"


def test_a_nested_key_given_twice_names_its_path_and_both_lines(tmp_path: Path) -> None:
    custom = write(tmp_path / "my.yaml", "trainers:\n  critic:\n    lr: 1.0e-5\n    seed: 1\n    lr: 2.0e-5\n")
    with pytest.raises(ConfigError) as excinfo:
        resolve("dmd2", recipe="tiny-digits-4step", cli={"custom_config_path": custom})
    assert str(excinfo.value) == f"{custom}:5: key 'trainers.critic.lr' is given twice (first at line 3)"
    roles = write(tmp_path / "roles.yaml", "trainers:\n  critic: {lr: 1.0e-5}\n  critic: {lr: 2.0e-5}\n")
    with pytest.raises(ConfigError, match=r"roles\.yaml:3: key 'trainers\.critic' is given twice \(first at line 2\)"):
        resolve("dmd2", recipe="tiny-digits-4step", cli={"custom_config_path": roles})
    custom_map = write(tmp_path / "c.yaml", "custom:\n  items:\n    - {a: 1, b: 2, a: 3}\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml:3: key 'custom\.items\[0\]\.a' is given twice \(first at line 3\)"
    ):
        run(custom_config_path=custom_map)


def test_eval_config_goes_through_the_strict_loader(tmp_path: Path) -> None:
    config = write(tmp_path / "eval.yaml", "datasets:\n  - name: a\n    path: a.jsonl\n    name: b\n")
    args = run("eval", eval_prompt_data=DROP, eval_config=config).args
    with pytest.raises(ConfigError, match=rf"^--eval-config {config}:4: key 'datasets\[0\]\.name' is given twice"):
        eval_datasets(args)
    bad = write(tmp_path / "bad.yaml", "datasets:\n  - {name: a, path: a.jsonl, n_samples_per_eval_prompt: .nan}\n")
    with pytest.raises(
        ConfigError, match=r"datasets\[0\]\.n_samples_per_eval_prompt': expected an integer >= 1, got nan"
    ):
        eval_datasets(run("eval", eval_prompt_data=DROP, eval_config=bad).args)


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = "custom:\n  base: &b {x: 1, y: 2}\n  one: *b\n  two: {<<: *b, y: 3}\n"
    custom = run(custom_config_path=write(tmp_path / "c.yaml", text)).args.custom
    assert custom == {"base": {"x": 1, "y": 2}, "one": {"x": 1, "y": 2}, "two": {"x": 1, "y": 3}}
