"""Refusals (and the derivations next to them) of flags no other config test covers (torch-free).

One line each, naming the flag, its value and its source, as every ConfigError does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jobs_helpers import BASE, assert_names, rejected, run

from miles.config.resolve import resolve
from miles.core.errors import ConfigError


@pytest.mark.parametrize(
    ("dest", "value", "only"),
    [("train_backend", "megatron", "fsdp"), ("optimizer", "sgd", "adam"), ("advantage_estimator", "ppo", "grpo")],
)
def test_single_value_enums_refuse_any_other_value(dest: str, value: str, only: str) -> None:
    """These flags take only the values miles implements (one each, two for the advantage estimator); another one is
    refused, not ignored."""
    assert getattr(run(**{dest: only}).args, dest) == only
    assert_names(rejected(**{dest: value}), f"--{dest.replace('_', '-')}", repr(value), only)


def test_train_env_vars_values_must_be_strings_or_numbers() -> None:
    assert run(train_env_vars={"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 2}).args.train_env_vars["OMP_NUM_THREADS"] == 2
    assert_names(rejected(train_env_vars={"NCCL_DEBUG": ["INFO"]}), "--train-env-vars", "'NCCL_DEBUG'", "string")


def test_forward_dtype_must_equal_the_sglang_dit_precision() -> None:
    """The engine and the trainer run the DiT in one dtype: --sglang-dit-precision must agree."""
    args = resolve("rl", cli={**BASE, "diffusion_forward_dtype": "fp16"}, sglang={"dit_precision": "fp16"}).args
    assert args.diffusion_forward_dtype == "fp16"
    with pytest.raises(ConfigError) as excinfo:
        resolve("rl", cli={**BASE, "diffusion_forward_dtype": "bf16"}, sglang={"dit_precision": "fp16"})
    assert_names(str(excinfo.value), "--diffusion-forward-dtype bf16 (cli)", "--sglang-dit-precision fp16")


def test_recompute_old_log_prob_is_for_policy_loss_only() -> None:
    assert run(diffusion_recompute_old_log_prob=True).args.diffusion_recompute_old_log_prob is True
    message = rejected(diffusion_recompute_old_log_prob=True, loss_type="nft", use_ema=True)
    assert_names(message, "--diffusion-recompute-old-log-prob on (cli)", "--loss-type policy_loss only", "nft")


def test_grpo_guard_needs_the_flow_sde_kernel() -> None:
    """RatioNorm normalises the Flow-SDE Gaussian's log-ratio; CPS has no 1/(2 s^2) to normalise, and the guard is
    policy_loss's option."""
    assert run(diffusion_grpo_guard=True).args.diffusion_grpo_guard is True
    message = rejected(diffusion_grpo_guard=True, diffusion_sde_type="cps")
    assert_names(
        message, "--diffusion-grpo-guard on (cli)", "--diffusion-sde-type cps (cli)", "use --diffusion-sde-type sde"
    )
    message = rejected(diffusion_grpo_guard=True, loss_type="nft", use_ema=True)
    assert_names(message, "--diffusion-grpo-guard on (cli)", "--loss-type policy_loss only", "nft")


@pytest.mark.parametrize(
    ("job", "dest", "value", "why"),
    [
        ("sft", "save_debug_rollout_data", "r/{rollout_id}.pt", "`miles train sft` makes no rollouts to save"),
        ("rollout-only", "save_debug_train_data", "t/{rollout_id}.pt", "`miles rollout-only` saves no train data"),
        ("sft", "dump_details", "dumps", "`miles train sft` writes no debug dumps"),
        ("eval", "load_debug_rollout_data", "r.pt", "`miles eval` trains on no saved rollout"),
    ],
)
def test_debug_dumps_a_job_never_writes_are_refused(job: str, dest: str, value: str, why: str) -> None:
    assert_names(rejected(job, **{dest: value}), f"--{dest.replace('_', '-')} {value} (cli)", why)


def test_dump_details_fills_the_dump_paths_the_job_writes() -> None:
    here = os.getcwd()  # every path of a resolved job is absolute, against the working folder
    rl = run(dump_details="dumps/").args
    assert rl.save_debug_rollout_data == f"{here}/dumps/rollout_data/{{rollout_id}}.pt"
    assert rl.save_debug_train_data == f"{here}/dumps/train_data/{{rollout_id}}.pt"
    assert rl.source_of("save_debug_train_data") == "derived"
    # an explicit path wins; rollout-only writes no train data
    mine = run(dump_details="dumps", save_debug_rollout_data="mine/{rollout_id}.pt").args
    assert mine.save_debug_rollout_data == f"{here}/mine/{{rollout_id}}.pt"
    rollout_only = run("rollout-only", dump_details="dumps").args
    assert rollout_only.save_debug_rollout_data == f"{here}/dumps/rollout_data/{{rollout_id}}.pt"
    assert rollout_only.save_debug_train_data is None
    assert run().args.save_debug_rollout_data is None  # nothing is dumped unless asked


def test_subsample_needs_saved_rollouts() -> None:
    message = rejected(load_debug_rollout_data_subsample=0.5)
    assert_names(message, "--load-debug-rollout-data-subsample 0.5 (cli)", "requires --load-debug-rollout-data")


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"loss_type": "nft", "use_ema": True}, ("--loss-type nft (cli) trains an unguided forward", "policy_loss")),
        ({"loss_type": "dpo"}, ("--loss-type dpo (cli) trains an unguided forward", "custom_loss")),
        ({"debug_rollout_only": True}, ("--debug-rollout-only on (cli) trains nothing",)),
        ({"diffusion_guidance_scale": 1.0}, ("CFG is off in training", "--diffusion-guidance-scale 1.0 (cli)")),
        ({"hf_checkpoint": "tiny-flux"}, ("model family 'flux'", "guidance-distilled", "--diffusion-true-cfg-scale")),
        (
            {"hf_checkpoint": "tiny-qwen-image", "diffusion_true_cfg_scale": 1.0},
            ("CFG is off in training", "--diffusion-true-cfg-scale 1.0 (cli)"),
        ),
        ({"hf_checkpoint": "tiny-ltx2", "diffusion_guidance_scale": 1.0}, ("model family 'ltx' trains without CFG",)),
    ],
    ids=["nft", "dpo", "rollout-only-mode", "no-cfg", "flux-embedded", "qwen-true-cfg-1", "ltx"],
)
def test_cfg_uncond_grad_detach_needs_a_trained_cfg_forward(changes: dict, names: tuple[str, ...]) -> None:
    """`--diffusion-cfg-uncond-grad detach` detaches the unconditional branch of the trained CFG forward: refused where
    the method trains an unguided forward, nothing trains, CFG is off, or the family has no negative branch."""
    assert_names(
        rejected(diffusion_cfg_uncond_grad="detach", **changes), "--diffusion-cfg-uncond-grad detach (cli)", *names
    )
    assert run(**changes).args.diffusion_cfg_uncond_grad == "full"  # the default is accepted everywhere


@pytest.mark.parametrize("job", ["sft", "dmd2", "eval", "rollout-only"])
def test_cfg_uncond_grad_is_for_the_jobs_that_train_on_rollouts(job: str) -> None:
    assert_names(rejected(job, diffusion_cfg_uncond_grad="detach"), "--diffusion-cfg-uncond-grad", "`miles train rl`")


def test_cfg_uncond_grad_detach_is_accepted_where_cfg_is_trained() -> None:
    for changes in (
        {},
        {"loss_type": "custom_loss", "custom_loss_function_path": "my.loss"},
        {"hf_checkpoint": "tiny-flux", "diffusion_true_cfg_scale": 2.0},  # true CFG beside the embedded guidance
        {"hf_checkpoint": "tiny-qwen-image"},  # its guidance scale is the true-CFG scale
    ):
        assert run(diffusion_cfg_uncond_grad="detach", **changes).args.diffusion_cfg_uncond_grad == "detach"
    assert run("replay", diffusion_cfg_uncond_grad="detach").args.diffusion_cfg_uncond_grad == "detach"


def test_cfg_uncond_grad_refusal_is_one_line_and_exit_2_before_ray() -> None:
    """On the command line: exit 2, one line on stderr, neither torch nor Ray imported."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "from miles_cli.main import main\n"
        "argv = ['train', 'rl', '--recipe', 'tiny-digits-grpo', '--loss-type', 'nft', '--use-ema',\n"
        "        '--diffusion-cfg-uncond-grad', 'detach']\n"
        "code = main(argv)\n"
        "print(f'EXIT={code} HEAVY=' + ','.join(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=60
    )
    assert result.stdout.strip().endswith("EXIT=2 HEAVY="), (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert_names(lines[0], "--diffusion-cfg-uncond-grad detach (cli)", "--loss-type nft (cli)")
