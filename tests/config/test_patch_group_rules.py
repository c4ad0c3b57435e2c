"""--rollout-patch-group: miles applies none of the reference's engine-side parity patches to sglang, so every value
is refused with one line saying why (in-process: nothing to patch; sglang: no patches shipped), except a group the
model family honours in its own forward (ltx's `ltx`, on the in-process engine). Torch-free, fast."""

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


def test_the_ltx_group_is_honoured_for_the_ltx_family_on_the_in_process_engine() -> None:
    ltx = {"hf_checkpoint": "tiny-ltx2", "diffusion_output_num_frames": 9, "diffusion_guidance_scale": 1.0}
    assert run(rollout_patch_group=["ltx"], rollout_backend="diffusers", **ltx).args.rollout_patch_group == ["ltx"]
    # the same group for another family, or another group for ltx: refused as before
    message = rejected(rollout_patch_group=["ltx"], rollout_backend="diffusers")
    assert_names(message, "--rollout-patch-group ltx (cli)", "nothing to patch")
    message = rejected(rollout_patch_group=["ltx", "sgld"], rollout_backend="diffusers", **ltx)
    assert_names(message, "--rollout-patch-group ltx,sgld (cli)", "nothing to patch")
