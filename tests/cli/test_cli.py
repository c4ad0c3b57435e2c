"""The `miles` command line, in-process (fast), plus two subprocess checks: no torch/Ray, shell completion."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from miles.config.catalog import ALL_FLAGS, GROUPS
from miles.config.flags import BOOL, TRISTATE
from miles.config.recipes import shipped_recipes
from miles_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

Run = Callable[..., tuple[int, str, str]]

JOB_COMMANDS = [
    ["train", "rl"],
    ["train", "sft"],
    ["train", "dmd2"],
    ["eval"],
    ["rollout-only"],
    ["replay"],
    ["inspect-config"],
]


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run `miles ARGV...` in-process: (exit code, stdout, stderr), ANSI codes stripped."""
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.delenv("MILES_DIFFUSION_MODEL_FAMILY", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, _ANSI.sub("", out), _ANSI.sub("", err)

    return run


def inspect_json(cli: Run, *argv: str) -> dict[str, Any]:
    code, out, err = cli("inspect-config", *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def has_option(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


# ---- help ----------------------------------------------------------------------------------


def test_top_level_help(cli: Run) -> None:
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("train", "eval", "rollout-only", "replay", "inspect-config", "recipes"):
        assert has_option(out, command), command


def test_train_help_lists_the_training_jobs(cli: Run) -> None:
    code, out, _ = cli("train", "--help")
    assert code == 0
    for job in ("rl", "sft", "dmd2"):
        assert re.search(rf"\b{job}\b", out), job


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=" ".join)
def test_job_help_lists_every_flag_and_panel(cli: Run, command: list[str]) -> None:
    code, out, _ = cli(*command, "--help")
    assert code == 0
    missing = [flag.option for flag in ALL_FLAGS if not has_option(out, flag.option)]
    assert not missing, f"not in `miles {' '.join(command)} --help`: {missing}"
    negatives = [f.negative_option() for f in ALL_FLAGS if f.kind in (BOOL, TRISTATE)]
    assert not [option for option in negatives if not has_option(out, option)]
    aliases = [f"--{alias}" for flag in ALL_FLAGS for alias in flag.aliases]
    assert not [option for option in aliases if not has_option(out, option)]
    panels = [group for group in GROUPS if not re.search(rf"[─-] {re.escape(group)} [─-]", out)]
    assert not panels, f"panels missing: {panels}"
    for meta in ("--recipe", "--override", "--all"):
        assert has_option(out, meta)


def test_inspect_config_help_has_its_own_options(cli: Run) -> None:
    _, out, _ = cli("inspect-config", "--help")
    assert has_option(out, "--job")
    assert has_option(out, "--format")


def test_recipes_help(cli: Run) -> None:
    code, out, _ = cli("recipes", "--help")
    assert code == 0
    assert "recipes" in out


def test_no_arguments_prints_help_without_an_empty_error(cli: Run) -> None:
    code, out, err = cli()
    assert code == 2
    assert "train" in out
    assert "error" not in err


# ---- inspect-config -------------------------------------------------------------------------------


def test_inspect_config_json_of_a_dmd2_recipe(cli: Run) -> None:
    data = inspect_json(cli, "--recipe", "sd35-4step")
    assert set(data) == {"job", "trainers", "sources"}
    assert data["job"] == "dmd2"
    assert set(data["trainers"]) == {"actor", "critic"}
    assert set(data["sources"]) == {"actor", "critic"}
    assert "override:critic" in data["sources"]["critic"].values()
    assert data["sources"]["critic"]["loss_type"] == "override:critic"
    assert data["trainers"]["critic"]["loss_type"] == "dmd2_critic"
    assert data["trainers"]["actor"]["loss_type"] == "dmd2"
    assert "override:critic" not in data["sources"]["actor"].values()


def test_inspect_config_of_the_tiny_dmd2_recipe_shows_critic_and_actor_apart(cli: Run) -> None:
    data = inspect_json(cli, "--recipe", "tiny-digits-4step")
    critic, actor = data["trainers"]["critic"], data["trainers"]["actor"]
    differ = {k for k in critic if critic[k] != actor.get(k)}
    assert {"loss_type", "lr"} <= differ
    assert (critic["lr"], actor["lr"]) == (2e-4, 1e-4)
    assert critic["hf_checkpoint"] == actor["teacher_checkpoint"] == "tiny-sd3-digits-sft"


def test_inspect_config_yaml_round_trip(cli: Run, tmp_path: Path) -> None:
    # A fixed --output-dir: its default carries a timestamp.
    base = ("--recipe", "sd35-4step", "--output-dir", "runs/fixed", "--override", "critic.lr=2e-6")
    code, text, err = cli("inspect-config", *base, "--format", "yaml")
    assert code == 0, err
    path = tmp_path / "resolved.yaml"
    path.write_text(text)

    original = inspect_json(cli, *base)
    again = inspect_json(cli, "--custom-config-path", str(path))

    def trainers(data: dict[str, Any]) -> dict[str, Any]:
        # custom_config_path is the one value that differs by design: it points at the YAML.
        return {
            role: {k: v for k, v in values.items() if k != "custom_config_path"}
            for role, values in data["trainers"].items()
        }

    assert again["job"] == "dmd2"
    assert trainers(again) == trainers(original)
    assert again["trainers"]["critic"]["lr"] == 2e-6


def test_inspect_config_table(cli: Run) -> None:
    code, out, _ = cli("inspect-config", "--recipe", "sd35-4step")
    assert code == 0
    assert "trainers critic, actor" in out
    assert "override:critic" in out
    assert "--loss-type" in out


def test_inspect_config_rejects_an_unknown_format(cli: Run) -> None:
    code, _, err = cli("inspect-config", "--recipe", "tiny-digits-grpo", "--format", "xml")
    assert code == 2
    assert "--format xml" in err


def test_invariant_violation_is_one_line_and_exit_2(cli: Run) -> None:
    code, out, err = cli("inspect-config", "--recipe", "sd3-ocr-grpo", "--global-batch-size", "7")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "invariant" in lines[0]
    assert "--global-batch-size 7" in lines[0]
    assert "128" in lines[0]
    assert "Traceback" not in err


def test_misspelled_flag_suggests_the_right_one(cli: Run) -> None:
    code, _, err = cli("inspect-config", "--recipe", "sd3-ocr-grpo", "--rollout-bach-size", "4")
    assert code == 2
    assert "--rollout-bach-size" in err
    assert "did you mean --rollout-batch-size" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_value_is_a_usage_error(cli: Run) -> None:
    code, _, err = cli("inspect-config", "--recipe", "tiny-digits-grpo", "--rollout-batch-size", "many")
    assert code == 2
    assert "--rollout-batch-size" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_recipe_suggests_a_shipped_one(cli: Run) -> None:
    code, _, err = cli("inspect-config", "--recipe", "tiny-digits-grp")
    assert code == 2
    assert "tiny-digits-grpo" in err


def test_recipes_lists_every_shipped_recipe(cli: Run) -> None:
    code, out, _ = cli("recipes")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith(" ")]
    assert sorted(names) == sorted(shipped_recipes())
    assert "dmd2" in out
    # the GPU recipes name the curve to expect, with its source, on the lines below their own
    expects = [line.strip() for line in out.splitlines() if line.lstrip().startswith("expect: ")]
    assert len(expects) >= 9
    assert "eval/pickscore_test about 0.78 after 100" in " ".join(out.split())


# ---- argv shapes ----------------------------------------------------------------------------------------------


def test_argparse_style_multi_value_flags(cli: Run) -> None:
    data = inspect_json(
        cli,
        "--recipe",
        "tiny-digits-grpo",
        "--eval-prompt-data",
        "a",
        "p1.jsonl",
        "--eval-prompt-data",
        "b",
        "p2.jsonl",
        "--lora-target-modules",
        "to_q",
        "to_k",
    )
    actor = data["trainers"]["actor"]
    assert actor["eval_prompt_data"] == {"a": os.path.abspath("p1.jsonl"), "b": os.path.abspath("p2.jsonl")}
    assert actor["lora_target_modules"] == ["to_q", "to_k"]
    assert data["sources"]["actor"]["eval_prompt_data"] == "cli"
    assert data["sources"]["actor"]["lora_target_modules"] == "cli"


def test_single_token_multi_value_forms(cli: Run) -> None:
    data = inspect_json(
        cli, "--recipe", "tiny-digits-grpo", "--eval-prompt-data", "a=p1.jsonl", "--lora-target-modules", "to_q,to_k"
    )
    actor = data["trainers"]["actor"]
    assert actor["eval_prompt_data"] == {"a": os.path.abspath("p1.jsonl")}
    assert actor["lora_target_modules"] == ["to_q", "to_k"]


def test_no_flag_overrides_a_recipe_true(cli: Run) -> None:
    # sd3-ocr-grpo sets colocate: true (and lora_ipc_weight_sync, which needs colocate).
    assert inspect_json(cli, "--recipe", "sd3-ocr-grpo")["trainers"]["actor"]["colocate"] is True
    data = inspect_json(cli, "--recipe", "sd3-ocr-grpo", "--no-colocate", "--no-lora-ipc-weight-sync")
    actor, sources = data["trainers"]["actor"], data["sources"]["actor"]
    assert (actor["colocate"], sources["colocate"]) == (False, "cli")
    assert (actor["lora_ipc_weight_sync"], sources["lora_ipc_weight_sync"]) == (False, "cli")
    # Nothing forces the colocated values any more.
    assert actor["rollout_num_gpus"] is None
    assert actor["offload_train"] is None


def test_sglang_passthrough_on_the_command_line(cli: Run) -> None:
    data = inspect_json(cli, "--recipe", "tiny-digits-grpo", "--sglang-attention-backend", "fa3")
    assert data["trainers"]["actor"]["sglang_args"] == {"attention_backend": "fa3"}
    code, _, err = cli("inspect-config", "--recipe", "tiny-digits-grpo", "--sglang-port", "30000")
    assert code == 2
    assert "--sglang-port" in err


def test_override_on_the_command_line(cli: Run) -> None:
    data = inspect_json(cli, "--recipe", "tiny-digits-4step", "--override", "critic.lr=5e-6")
    assert data["trainers"]["critic"]["lr"] == 5e-6
    assert data["sources"]["critic"]["lr"] == "override:critic"
    assert data["trainers"]["actor"]["lr"] == 1e-4
    code, _, err = cli("inspect-config", "--recipe", "tiny-digits-4step", "--override", "judge.lr=5e-6")
    assert code == 2
    assert "'judge'" in err


def test_job_option_of_inspect_config(cli: Run) -> None:
    data = inspect_json(cli, "--job", "eval", "--recipe", "tiny-digits-grpo")
    assert data["job"] == "eval"
    assert list(data["trainers"]) == ["actor"]
    code, _, err = cli("inspect-config", "--job", "sft", "--recipe", "tiny-digits-grpo")
    assert code == 2
    assert "`miles train rl`" in err


# ---- subprocesses ----------------------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    return env


def test_cli_never_imports_torch_or_ray() -> None:
    code = (
        "import sys\n"
        "from miles_cli.main import main\n"
        "assert main(['--help']) == 0\n"
        "assert main(['inspect-config', '--recipe', 'sd35-4step']) == 0\n"
        "assert main(['plan', '--recipe', 'sd35-4step', '--cluster', '2x8']) == 0\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(COLUMNS="120"), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY=\n" in result.stdout or result.stdout.rstrip().endswith("HEAVY=")


def test_bash_completion_offers_flags() -> None:
    # Typer's bash protocol: _MILES_COMPLETE=complete_bash, the words in COMP_WORDS and the index of
    # the word being completed in COMP_CWORD (typer/_completion_classes.py BashComplete).
    exe = shutil.which("miles")
    command = [exe] if exe else [sys.executable, "-c", "from miles_cli.main import entry; entry()"]
    env = _env(_MILES_COMPLETE="complete_bash", COMP_WORDS="miles train rl --rollout-b", COMP_CWORD="3")
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    offered = result.stdout.split()
    assert "--rollout-batch-size" in offered
    assert all(option.startswith("--rollout-b") for option in offered)
