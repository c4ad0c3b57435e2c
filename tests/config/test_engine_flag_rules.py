"""Engine flags that mean something only in some settings: each works there, or is refused with one line.

--diffusion-generator-device (its default cuda resolves to cpu without GPUs), --use-distributed-post (sglang
engines only), --sglang-flow-shift (set through --diffusion-flow-shift), --update-weight-buffer-size (no
chunks in a LoRA sync to sglang engines without --colocate). Torch-free and fast.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from jobs_helpers import EVAL_DATA, assert_names, rejected, run

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.utils.sglang_env import ACTORS_PER_NODE_VAR, actors_per_node, gpus_present
from miles_cli.main import main

SGLANG = {"rollout_backend": "sglang", "sglang_python": sys.executable, "distributed_backend": "gloo"}
no_gpu = pytest.mark.skipif(gpus_present(), reason="the machine has GPUs: cuda is a valid generator device")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)


# ---- --diffusion-generator-device ------------------------------------------------------------------------


@no_gpu
def test_default_generator_device_resolves_to_cpu_without_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    resolved = run().args
    assert resolved.diffusion_generator_device == "cpu"
    assert resolved.source_of("diffusion_generator_device") == "derived"
    code, out, err = _cli(capsys, "inspect-config", "--recipe", "sd3-ocr-grpo", "--all", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["trainers"]["actor"]["diffusion_generator_device"] == "cpu"
    assert data["sources"]["actor"]["diffusion_generator_device"] == "derived"


@no_gpu
def test_explicit_cuda_generator_is_refused_without_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    message = rejected(diffusion_generator_device="cuda")
    assert_names(message, "--diffusion-generator-device cuda (cli)", "needs CUDA", "no GPU", "cpu")
    assert_names(rejected("eval", diffusion_generator_device="cuda:1", **EVAL_DATA), "cuda:1")
    code, _, err = _cli(capsys, "train", "rl", "--recipe", "tiny-digits-grpo", "--diffusion-generator-device", "cuda")
    assert code == 2
    assert "--diffusion-generator-device cuda" in err and "needs CUDA" in err


def test_cpu_generator_is_kept_and_a_job_without_engines_keeps_its_value() -> None:
    assert run(diffusion_generator_device="cpu").args.diffusion_generator_device == "cpu"
    sft = resolve("sft", recipe="wan22-lora-sft", cli={"diffusion_generator_device": "cuda"}).args
    assert sft.diffusion_generator_device == "cuda"  # SFT without eval sets runs no engine: nothing draws noise
    if not gpus_present():  # with eval sets it evaluates after its last iteration on an engine drawing on CUDA
        with pytest.raises(ConfigError) as excinfo:
            resolve("sft", recipe="tiny-digits-sft", cli={"diffusion_generator_device": "cuda"})
        assert_names(str(excinfo.value), "--diffusion-generator-device cuda (cli)", "needs CUDA")


@pytest.mark.parametrize("value", ["gpu", "cpu:0", "cuda:x", "mps"])
def test_generator_device_must_be_cpu_or_cuda(value: str) -> None:
    assert_names(rejected(diffusion_generator_device=value), f"--diffusion-generator-device {value}", "cuda:N")


# ---- --use-distributed-post -------------------------------------------------------------------------------


def test_distributed_post_is_refused_for_the_in_process_engine() -> None:
    message = rejected(use_distributed_post=True, rollout_backend="diffusers")
    assert_names(message, "--use-distributed-post on (cli)", "sglang engines only", "--rollout-backend diffusers")


def test_distributed_post_is_refused_for_a_job_without_engines() -> None:
    with pytest.raises(ConfigError) as excinfo:
        resolve("sft", recipe="wan22-lora-sft", cli={"use_distributed_post": True})
    assert_names(str(excinfo.value), "--use-distributed-post on (cli)", "`miles train sft` runs no rollout engines")


def test_distributed_post_is_accepted_with_sglang_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACTORS_PER_NODE_VAR, raising=False)
    assert run(use_distributed_post=True, **SGLANG).args.use_distributed_post is True
    monkeypatch.setenv(ACTORS_PER_NODE_VAR, "3")
    assert run(use_distributed_post=True, **SGLANG).args.use_distributed_post is True


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_actor_count_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ACTORS_PER_NODE_VAR, value)
    message = rejected(use_distributed_post=True, **SGLANG)
    assert_names(message, "--use-distributed-post on", f"${ACTORS_PER_NODE_VAR}", repr(value))


def test_actors_per_node_reads_the_variable() -> None:
    assert actors_per_node({}) == 1
    assert actors_per_node({ACTORS_PER_NODE_VAR: " 4 "}) == 4
    with pytest.raises(ValueError, match=ACTORS_PER_NODE_VAR):
        actors_per_node({ACTORS_PER_NODE_VAR: "0"})


# ---- --diffusion-flow-shift through the sglang passthrough ----------------------------------------------


def test_sglang_flow_shift_passthrough_names_the_miles_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "train", "rl", "--recipe", "tiny-digits-grpo", "--sglang-flow-shift", "3.0")
    assert code == 2
    assert "--sglang-flow-shift" in err and "--diffusion-flow-shift" in err
    assert run(diffusion_flow_shift=3.0, **SGLANG).args.diffusion_flow_shift == 3.0


# ---- --update-weight-buffer-size ------------------------------------------------------------------------


def test_buffer_size_is_refused_where_a_sync_has_no_chunks() -> None:
    lora = {"use_lora": True, "update_weight_buffer_size": 1 << 20}
    message = rejected(**lora, **SGLANG)
    assert_names(message, "--update-weight-buffer-size 1048576 (cli)", "--use-lora on", "/v1/set_lora")
    # full weights to sglang (disk shards) and LoRA on the diffusers engine (merged chunks) are sized by it
    assert run(update_weight_buffer_size=1 << 20, **SGLANG).args.update_weight_buffer_size == 1 << 20
    assert run(**lora, rollout_backend="diffusers").args.update_weight_buffer_size == 1 << 20
