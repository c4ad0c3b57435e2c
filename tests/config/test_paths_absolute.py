"""Every path of a resolved job is absolute against the working folder (`miles.config.paths`), so that an actor
whose process runs in another folder (a raylet's, on another host) reads and writes where the driver meant: flags,
defaults, derived values, recipe values, trainer overrides; built-in names, hub ids and URLs kept (torch-free)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jobs_helpers import cli_for, run

from miles.config.catalog import ALL_FLAGS
from miles.config.export import to_yaml_text
from miles.config.flags import NAMED_PATHS, PATH
from miles.config.paths import DATA, MODEL, OUTPUT, PATH_RULES, TEMPLATE, absolute_path
from miles.config.resolve import resolve

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working folder of the job: an empty folder under tmp_path."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY", raising=False)
    return folder


def test_relative_paths_become_absolute_against_the_working_folder(here: Path) -> None:
    args = run(output_dir="out", save="ckpt/", load="../old/./ckpt", prompt_data="data/p.jsonl").args
    assert args.output_dir == str(here / "out")
    assert args.save == str(here / "ckpt")  # normalised: no trailing slash, no `.`, no `..`
    assert args.load == str(here.parent / "old" / "ckpt")
    assert args.prompt_data == str(here / "data" / "p.jsonl")
    # the sources stay what they were
    assert (args.source_of("output_dir"), args.source_of("save")) == ("cli", "cli")


def test_defaults_and_derived_paths_too(here: Path) -> None:
    args = run(dump_details="dumps").args
    assert args.wandb_dir == str(here / "wandb")
    assert args.miles_dashboard_workspace == str(here / "miles_dashboard")
    assert args.source_of("wandb_dir") == "default"
    assert args.output_dir.startswith(str(here / "runs" / "rl-"))  # derived: runs/<job>-<timestamp>
    assert args.source_of("output_dir") == "derived"
    assert args.save_debug_rollout_data == f"{here}/dumps/rollout_data/{{rollout_id}}.pt"


def test_an_absolute_path_is_only_normalised(here: Path) -> None:
    args = run(output_dir="/srv/runs//a/../b/", save=str(here / "ckpt")).args
    assert (args.output_dir, args.save) == ("/srv/runs/b", str(here / "ckpt"))


def test_templates_keep_their_placeholders(here: Path) -> None:
    args = run(save_debug_rollout_data="dump/{}.pt", save_debug_train_data="./train/{rollout_id}/pairs.pt").args
    assert args.save_debug_rollout_data == f"{here}/dump/{{}}.pt"
    assert args.save_debug_train_data == f"{here}/train/{{rollout_id}}/pairs.pt"
    assert args.save_debug_rollout_data.format(3) == str(here / "dump" / "3.pt")
    replay = resolve("replay", cli=cli_for("replay"), replay_path="saved/rollout_{rollout_id}.pt").args
    assert replay.load_debug_rollout_data == f"{here}/saved/rollout_{{rollout_id}}.pt"


def test_home_is_expanded(here: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = run(save="~/ckpt", prompt_data="~/data/p.jsonl").args
    assert args.save == str(tmp_path / "home" / "ckpt")
    assert args.prompt_data == str(tmp_path / "home" / "data" / "p.jsonl")


def test_named_paths_each_path_and_builtin_sets_kept(here: Path) -> None:
    args = run(eval_prompt_data=["mine=evals/a.jsonl", "digits=digits:test"]).args
    assert args.eval_prompt_data == {"mine": str(here / "evals" / "a.jsonl"), "digits": "digits:test"}


def test_builtin_names_and_hub_ids_are_kept(here: Path) -> None:
    args = run(prompt_data="digits:labels").args
    assert (args.hf_checkpoint, args.prompt_data) == ("tiny-sd3", "digits:labels")
    # where they live: keyed by the name as given, so every reader still finds them
    assert set(args.inputs) == {"tiny-sd3", "digits:labels"}
    hub = run(hf_checkpoint="stabilityai/stable-diffusion-3.5-medium", diffusion_model_family="sd3").args
    assert hub.hf_checkpoint == "stabilityai/stable-diffusion-3.5-medium"


def test_a_model_path_is_a_folder_when_it_starts_like_one_or_is_here(here: Path) -> None:
    assert run(hf_checkpoint="./sd3-model").args.hf_checkpoint == str(here / "sd3-model")
    assert run(hf_checkpoint="runs/sft/checkpoint", diffusion_model_family="sd3").args.hf_checkpoint == str(
        here / "runs" / "sft" / "checkpoint"
    )  # no hub id has two slashes
    (here / "org" / "sd3-model").mkdir(parents=True)  # a folder named like a hub id, here: the folder
    assert run(hf_checkpoint="org/sd3-model").args.hf_checkpoint == str(here / "org" / "sd3-model")


def test_miles_home_places_are_absolute(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_HOME", "cache")
    args = run(prompt_data="digits:labels").args
    assert args.inputs == {
        "tiny-sd3": str(here / "cache" / "models" / "tiny-sd3"),
        "digits:labels": str(here / "cache" / "data" / "digits" / "labels.jsonl"),
    }


def test_a_recipes_relative_values_are_against_the_working_folder(here: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipes" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text(
        "job: rl\nhf_checkpoint: tiny-sd3\nprompt_data: data/train.jsonl\nsave: ckpt\nrm_type: digit\n"
        "rollout_batch_size: 8\nn_samples_per_prompt: 4\ndiffusion_num_sde_steps: 2\n"
        "actor_num_gpus_per_node: 1\nnum_gpus_per_node: 1\n"
    )
    args = resolve(None, recipe=str(recipe), cli={"output_dir": "out"}).args
    assert args.source_of("prompt_data") == "recipe"
    assert args.prompt_data == str(here / "data" / "train.jsonl")  # not the recipe's folder
    assert args.save == str(here / "ckpt")


def test_trainer_overrides_are_absolute(here: Path) -> None:
    resolved = resolve(
        "dmd2",
        cli=cli_for("dmd2", teacher_checkpoint="./teacher", save="ckpt", diffusion_model_family="sd3"),
        overrides=["critic.hf_checkpoint=../critic-start"],
    )
    assert resolved.args.teacher_checkpoint == str(here / "teacher")
    critic = resolved.trainer_args["critic"]
    assert critic.hf_checkpoint == str(here.parent / "critic-start")
    assert critic.save == str(here / "ckpt" / "critic")


def test_a_saved_config_runs_the_same_from_another_folder(
    here: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run(output_dir="out", save="ckpt", prompt_data="data/p.jsonl").args
    config = here / "config.yaml"
    config.write_text(to_yaml_text(first))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = resolve(None, cli={"custom_config_path": "../work/config.yaml"}).args
    for dest in ("output_dir", "save", "prompt_data"):
        assert again.to_dict()[dest] == first.to_dict()[dest]
    assert again.custom_config_path == str(config)


def test_inspect_config_shows_the_absolute_paths(
    here: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles_cli.main import main

    monkeypatch.setenv("COLUMNS", "250")
    argv = ["inspect-config", "--recipe", "tiny-digits-grpo", "--output-dir", "out", "--save", "ckpt"]
    assert main([*argv, "--format", "yaml"]) == 0
    out = capsys.readouterr().out
    assert f"output_dir: {here / 'out'}\n" in out
    assert f"save: {here / 'ckpt'}\n" in out
    assert main(argv) == 0
    table = _ANSI.sub("", capsys.readouterr().out)
    assert re.search(rf"--save\s+.*{re.escape(str(here / 'ckpt'))}\s+.*cli", table)


def test_what_is_not_a_path_is_kept() -> None:
    cwd = "/work/job"
    for rule in (OUTPUT, TEMPLATE, DATA, MODEL):
        assert absolute_path("", rule, cwd) == ""
        assert absolute_path("https://example.com/p.jsonl", rule, cwd) == "https://example.com/p.jsonl"
        assert absolute_path("hf://datasets/org/name", rule, cwd) == "hf://datasets/org/name"
    assert absolute_path("tiny-sd3", MODEL, cwd) == "tiny-sd3"
    assert absolute_path("tiny-sd3", OUTPUT, cwd) == "/work/job/tiny-sd3"  # an output folder of that name
    assert absolute_path("digits:test", DATA, cwd) == "digits:test"
    assert absolute_path("mydata:test", DATA, cwd) == "/work/job/mydata:test"  # no built-in set: a file
    assert absolute_path("org/name", MODEL, cwd) == "org/name"
    assert absolute_path("org/name", DATA, cwd) == "/work/job/org/name"
    assert absolute_path("../models/x", MODEL, cwd) == "/work/models/x"


def test_the_table_names_every_path_flag_of_the_catalogue() -> None:
    path_flags = {flag.dest for flag in ALL_FLAGS if flag.kind in (PATH, NAMED_PATHS)}
    assert set(PATH_RULES) - {"inputs"} == path_flags
    assert set(PATH_RULES.values()) <= {OUTPUT, TEMPLATE, DATA, MODEL}
