"""A job's built-in names are resolved once, by the config, into `args.inputs`; below, `input_path` reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from miles.builtin.inputs import prepare_inputs
from miles.builtin.names import builtin_path, builtin_paths
from miles.config.args import DERIVED
from miles.config.export import to_json_dict, to_yaml_text
from miles.config.resolution import schema_args
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.core.inputs import input_path


def test_the_config_resolves_every_built_in_name_of_a_job_once(miles_session_home: Path) -> None:
    job = resolve("rl", recipe="tiny-digits-grpo")
    args = job.args
    home = miles_session_home
    assert args.inputs == {
        "tiny-sd3-digits-sft-short": str(home / "models" / "tiny-sd3-digits-sft-short"),
        "digits:labels": str(home / "data" / "digits" / "labels.jsonl"),
        "digits:test": str(home / "data" / "digits" / "test.jsonl"),
    }
    assert args.sources()["inputs"] == DERIVED
    assert job.trainer_args["actor"].inputs == args.inputs  # every trainer's copy carries it
    assert to_json_dict("rl", job.trainer_args)["trainers"]["actor"]["inputs"] == args.inputs  # config.json
    assert "inputs" not in yaml.safe_load(to_yaml_text(args))  # derived again from the flags on re-run


def test_a_trainer_override_and_the_dmd2_teacher_are_resolved_too(miles_session_home: Path) -> None:
    job = resolve(None, recipe="tiny-digits-4step", overrides=["critic.hf_checkpoint=tiny-sd3"])
    assert job.trainer_args["critic"].hf_checkpoint == "tiny-sd3"
    models = miles_session_home / "models"
    assert {k: v for k, v in job.args.inputs.items() if not k.startswith("digits:")} == {
        "tiny-sd3-digits-sft": str(models / "tiny-sd3-digits-sft"),  # --hf-checkpoint and the derived teacher
        "tiny-sd3": str(models / "tiny-sd3"),
    }


def test_paths_and_hub_ids_are_not_inputs_to_resolve(tmp_path: Path) -> None:
    args = resolve(
        "rl",
        recipe="tiny-digits-grpo",
        cli={"hf_checkpoint": str(tmp_path), "diffusion_model_family": "sd3", "prompt_data": "x.jsonl"},
    )
    assert str(tmp_path) not in args.args.inputs and "x.jsonl" not in args.args.inputs
    assert builtin_paths(["org/model", "digits:nope", None, 3, {"a": "digits:train"}]) == {
        "digits:train": str(builtin_path("digits:train"))
    }


def test_input_path_reads_the_mapping_and_passes_paths_through(miles_home: Path) -> None:
    args = schema_args(prompt_data="digits:labels", hf_checkpoint="~/ckpt")
    assert args.inputs == {"digits:labels": str(miles_home / "data" / "digits" / "labels.jsonl")}
    assert input_path(args, "~/ckpt") == Path.home() / "ckpt"
    assert input_path(args, "rel/file.jsonl") == Path("rel/file.jsonl")
    assert input_path(args, None) is None
    # a process that finds the built-in missing builds it where the config said
    path = input_path(args, "digits:labels")
    assert path == miles_home / "data" / "digits" / "labels.jsonl" and len(path.read_text().splitlines()) == 10


def test_a_process_with_another_miles_home_is_told_so(miles_home: Path, tmp_path: Path) -> None:
    args = schema_args(prompt_data="digits:labels")
    args.inputs = {"digits:labels": str(tmp_path / "elsewhere" / "labels.jsonl")}
    with pytest.raises(ConfigError, match="same MILES_HOME"):
        input_path(args, "digits:labels")


def test_prepare_inputs_builds_what_the_job_names(miles_home: Path) -> None:
    args = schema_args(prompt_data="digits:train", eval_prompt_data={"digits": "digits:test"})
    assert not (miles_home / "data" / "digits").exists()
    prepare_inputs(args)
    for name in ("train", "test"):
        assert (miles_home / "data" / "digits" / f"{name}.jsonl").is_file()
