"""--rollout-patch-group: miles applies none of the reference's engine-side parity patches, so every value is
refused with one line saying why (in-process: nothing to patch; sglang: no patches shipped). Torch-free, fast."""

from __future__ import annotations

import re
import sys

import pytest
from jobs_helpers import assert_names, rejected, run

from miles_cli.main import main

SGLANG = {"rollout_backend": "sglang", "sglang_python": sys.executable, "distributed_backend": "gloo"}


def test_no_patch_group_is_the_default() -> None:
    assert not run().args.rollout_patch_group


def test_a_patch_group_is_refused_on_the_in_process_engine() -> None:
    message = rejected(rollout_patch_group=["wan"], rollout_backend="diffusers")
    assert_names(message, "--rollout-patch-group wan (cli)", "--rollout-backend diffusers", "nothing to patch")


@pytest.mark.parametrize("groups", [["sgld"], ["wan"], ["ltx"], ["sgld", "wan"]])
def test_a_patch_group_is_refused_on_sglang_naming_what_it_would_align(groups: list[str]) -> None:
    message = rejected(rollout_patch_group=groups, **SGLANG)
    assert_names(message, "--rollout-patch-group", "no engine-side parity patches", *(f"{g}: " for g in groups))
    assert "--diffusion-debug-mode" in message


def test_the_cli_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect-config", "--recipe", "tiny-digits-grpo", "--rollout-patch-group", "sgld"])
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err)
    assert code == 2
    assert "--rollout-patch-group" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
