"""The hook checks: importable, of the right kind, callable the documented way; miles' own paths read, not run."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from conftest import Job

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
    assert check_hooks(job("rl")) == []  # the recipe's miles.rollout.step_strategy_hub.sde_window
    assert "miles.rollout.step_strategy_hub" not in set(sys.modules) - before
    assert check_hooks(job("rl", diffusion_step_strategy_path="miles.rollout.step_strategy_hub.sde_windw")) == [
        "--diffusion-step-strategy-path 'miles.rollout.step_strategy_hub.sde_windw': "
        "'miles.rollout.step_strategy_hub' has no attribute 'sde_windw'; expected fn(args, sample, num_steps, seed)"
    ]
