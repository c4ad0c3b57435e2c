"""The hook checks: importable, of the right kind, callable the documented way; miles' own paths read, not run."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from preflight_helpers import Job

from miles.config.catalog import FLAGS_BY_DEST
from miles.config.flags import DOTTED
from miles.preflight import find_problems
from miles.preflight.hooks import HOOKS, SPECIAL, check_hooks


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A hook module on sys.path, named after the test (never cached across tests)."""
    name = f"preflight_hooks_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            NOT_A_FUNCTION = 3

            def reward(args, samples):
                return [0.0] * len(samples)

            def reward_one_arg(args):
                return []

            async def generate(args, microgroup, sampling_params, *, evaluation=False):
                return microgroup

            class Source:
                def __init__(self, args):
                    self.args = args
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_every_dotted_flag_has_a_documented_call() -> None:
    dotted = {dest for dest, flag in FLAGS_BY_DEST.items() if flag.kind == DOTTED and flag.dest == dest}
    assert dotted == {hook.dest for hook in HOOKS} | set(SPECIAL)


def test_a_bad_hook_path(job: Job) -> None:
    assert find_problems(job("rl", custom_rm_path="no_such_pkg_xyz.rewards.score")) == [
        "--custom-rm-path 'no_such_pkg_xyz.rewards.score': cannot import module 'no_such_pkg_xyz.rewards' "
        "(ModuleNotFoundError: No module named 'no_such_pkg_xyz')"
    ]


def test_a_missing_attribute(job: Job, user_module: str) -> None:
    assert check_hooks(job("rl", custom_rm_path=f"{user_module}.nope")) == [
        f"--custom-rm-path '{user_module}.nope': '{user_module}' has no attribute 'nope'"
    ]


def test_a_non_callable_hook(job: Job, user_module: str) -> None:
    assert check_hooks(job("rl", custom_rm_path=f"{user_module}.NOT_A_FUNCTION")) == [
        f"--custom-rm-path '{user_module}.NOT_A_FUNCTION': names a int, not a function; expected fn(args, samples)"
    ]


def test_a_hook_of_the_wrong_arity(job: Job, user_module: str) -> None:
    assert check_hooks(job("rl", custom_rm_path=f"{user_module}.reward_one_arg")) == [
        f"--custom-rm-path '{user_module}.reward_one_arg': reward_one_arg(args) does not take that call (too many "
        "positional arguments); miles calls fn(args, samples)"
    ]


def test_good_hooks_pass(job: Job, user_module: str) -> None:
    resolved = job(
        "rl",
        custom_rm_path=f"{user_module}.reward",
        custom_generate_function_path=f"{user_module}.generate",
        data_source_path=f"{user_module}.Source",
    )
    assert check_hooks(resolved) == []


def test_a_class_hook_must_be_a_class(job: Job, user_module: str) -> None:
    assert check_hooks(job("rl", data_source_path=f"{user_module}.reward")) == [
        f"--data-source-path '{user_module}.reward': names a function, not a class; expected Class(args)"
    ]


def test_miles_paths_are_read_without_importing_them(job: Job) -> None:
    before = set(sys.modules)
    assert check_hooks(job("rl")) == []  # the recipe's miles.sampling.step_strategies.sde_window
    assert "miles.sampling.step_strategies" not in set(sys.modules) - before
    assert check_hooks(job("rl", diffusion_step_strategy_path="miles.sampling.step_strategies.sde_windw")) == [
        "--diffusion-step-strategy-path 'miles.sampling.step_strategies.sde_windw': "
        "'miles.sampling.step_strategies' has no attribute 'sde_windw'; expected fn(args, sample, num_steps, seed)"
    ]


# ---- a module that misbehaves at import: one problem line, nothing printed, Ctrl-C still stops it ----------------
@pytest.fixture
def bad_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """`bad_module(source)`: a module on sys.path holding `source` (then `def reward(args, samples)`)."""
    names: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"preflight_bad_{request.node.name.replace('[', '_').replace(']', '_')}_{len(names)}"
        body = textwrap.dedent(source) + "\ndef reward(args, samples):\n    return [0.0] * len(samples)\n"
        (tmp_path / f"{name}.py").write_text(body)
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


def test_a_module_that_exits_at_import(job: Job, bad_module, capsys: pytest.CaptureFixture[str]) -> None:
    name = bad_module("import sys\nsys.exit(0)\n")
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == [
        f"--custom-rm-path '{name}.reward': cannot import module '{name}' (SystemExit: 0); it exits when imported "
        '(sys.exit, or argparse\'s parse_args at module level): move that under `if __name__ == "__main__":`'
    ]
    assert capsys.readouterr() == ("", "")


def test_argparse_at_import_prints_nothing_posing_as_miles(
    job: Job, bad_module, capsys: pytest.CaptureFixture[str]
) -> None:
    name = bad_module("import argparse\nargparse.ArgumentParser(prog='miles').parse_args(['--nope'])\n")
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == [
        f"--custom-rm-path '{name}.reward': cannot import module '{name}' (SystemExit: 2); it exits when imported "
        '(sys.exit, or argparse\'s parse_args at module level): move that under `if __name__ == "__main__":`'
    ]
    assert capsys.readouterr() == ("", "")  # no `usage: miles ...` from the module


def test_what_a_module_prints_at_import_is_dropped(job: Job, bad_module, capsys: pytest.CaptureFixture[str]) -> None:
    name = bad_module(
        "import sys, warnings\nprint('usage: miles [-h]')\nprint('miles: error: x', file=sys.stderr)\n"
        "warnings.warn('deprecated at import')\nsys.stdout.fileno()\n"
    )
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == []
    assert capsys.readouterr() == ("", "")
    assert sys.stdout is not None and sys.stdin is not None


def test_input_at_import_fails_at_once(job: Job, bad_module) -> None:
    name = bad_module("input('password: ')\n")
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == [
        f"--custom-rm-path '{name}.reward': cannot import module '{name}' (EOFError: EOF when reading a line)"
    ]


def test_a_base_exception_at_import(job: Job, bad_module) -> None:
    name = bad_module("class Stop(BaseException):\n    pass\nraise Stop('from the module')\n")
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == [
        f"--custom-rm-path '{name}.reward': cannot import module '{name}' (Stop: from the module)"
    ]


def test_ctrl_c_during_an_import_is_not_caught(job: Job, bad_module) -> None:
    name = bad_module("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        check_hooks(job("rl", custom_rm_path=f"{name}.reward"))


def test_an_import_that_hangs_is_refused_at_the_deadline(
    job: Job, bad_module, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from miles.preflight import hooks

    monkeypatch.setattr(hooks, "IMPORT_DEADLINE_S", 0.3)
    name = bad_module("import time\ntry:\n    time.sleep(30)\nexcept Exception:\n    pass\n")  # swallows errors
    start = time.perf_counter()
    assert check_hooks(job("rl", custom_rm_path=f"{name}.reward")) == [
        f"--custom-rm-path '{name}.reward': importing '{name}' did not finish within 0.3 s; a module must not wait "
        "at import (on a server, a lock, input()): do that inside the function"
    ]
    assert time.perf_counter() - start < 5
    assert hooks.IMPORT_DEADLINE_S == 0.3 and name not in sys.modules


# ---- miles paths bound by assignment ----------------------------------------------------------------------------
def test_a_miles_constant_is_not_a_function(job: Job) -> None:
    """`MAX_LINE_BYTES = 1 << 20`: an expression, so the (torch-free) module is imported to tell."""
    assert check_hooks(job("rl", custom_rm_path="miles.data.prompt_file.MAX_LINE_BYTES")) == [
        "--custom-rm-path 'miles.data.prompt_file.MAX_LINE_BYTES': names a int, not a function; "
        "expected fn(args, samples)"
    ]


def test_a_literal_in_a_torch_module_is_refused_from_the_source(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """`MODEL_KEY = "model"` in miles.io.rollout_file (which imports torch): refused without importing it."""
    from miles.preflight import hooks

    def no_import(path: str, flag: str, seconds: float | None = None) -> None:
        raise AssertionError(f"{path} was imported")

    monkeypatch.setattr(hooks, "import_hook_object", no_import)
    assert check_hooks(job("rl", custom_rm_path="miles.io.rollout_file.MODEL_KEY")) == [
        "--custom-rm-path 'miles.io.rollout_file.MODEL_KEY': names a str, not a function; expected fn(args, samples)"
    ]
    assert check_hooks(job("rl", data_source_path="miles.core.sample.PENDING")) == [  # `PENDING, ... = "pending", ...`
        "--data-source-path 'miles.core.sample.PENDING': names a str, not a class; expected Class(args)"
    ]


def test_a_missing_pipeline_config_module_is_named(job: Job) -> None:
    assert check_hooks(job("rl", train_pipeline_config_path="no_such_pkg_xyz.Config")) == [
        "--train-pipeline-config-path 'no_such_pkg_xyz.Config': cannot import module 'no_such_pkg_xyz' "
        "(ModuleNotFoundError: No module named 'no_such_pkg_xyz')"
    ]
