"""The flag catalogue against the CLI reference (fast, torch-free)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import catalog
from miles.config.catalog import ALL_FLAGS, FLAGS_BY_DEST, GROUPS, flag_for
from miles.config.flags import (
    BOOL,
    DOTTED,
    ENUM,
    FLOAT,
    INT,
    INT_LIST,
    INT_RANGE,
    JSON,
    NAMED_PATHS,
    PATH,
    STR,
    STR_LIST,
    TRISTATE,
    WEIGHTS,
)
from miles.core.errors import ConfigError

# Every flag of the CLI reference's complete tables (and the "Other groups" / CI rows),
# written by hand from the reference: name -> (kind, default). Paired rows are split.
# Deliberate miles choices: --loss-type defaults to None (the job resolves it), and
# "derived" / "from dataset" / unset defaults are None.
FIXTURE: dict[str, tuple[str, object]] = {
    # Cluster
    "--actor-num-nodes": (INT, 1),
    "--actor-num-gpus-per-node": (INT, 8),
    "--rollout-num-gpus": (INT, None),
    "--rollout-num-gpus-per-engine": (INT, 1),
    "--num-gpus-per-node": (INT, 8),
    "--colocate": (BOOL, False),
    "--offload": (BOOL, False),
    "--offload-train": (TRISTATE, None),
    "--offload-rollout": (TRISTATE, None),
    "--distributed-backend": (STR, "nccl"),
    "--distributed-timeout-minutes": (INT, 10),
    # Training backend
    "--train-backend": (ENUM, "fsdp"),
    "--fsdp-master-dtype": (ENUM, "fp32"),
    "--fsdp-reduce-dtype": (ENUM, "fp32"),
    "--diffusion-forward-dtype": (ENUM, "bf16"),
    "--fsdp-cpu-offload": (BOOL, False),
    "--fsdp-cpu-backend": (STR, "gloo"),
    "--dp-replicate-size": (INT, 1),
    "--sequence-parallel-size": (INT, 1),
    "--ulysses-degree": (INT, 0),
    "--fsdp-attention-backend": (STR, None),
    "--fsdp-flow-shift": (FLOAT, None),
    "--gradient-checkpointing": (BOOL, False),
    "--deterministic-mode": (BOOL, False),
    "--train-env-vars": (JSON, {}),
    # Optimizer and schedule
    "--optimizer": (ENUM, "adam"),
    "--lr": (FLOAT, 1e-6),
    "--adam-beta1": (FLOAT, 0.9),
    "--adam-beta2": (FLOAT, 0.999),
    "--adam-eps": (FLOAT, 1e-8),
    "--weight-decay": (FLOAT, 0.0),
    "--clip-grad": (FLOAT, 1.0),
    "--lr-decay-style": (ENUM, "constant"),
    "--min-lr": (FLOAT, 0.0),
    "--lr-warmup-init": (FLOAT, 0.0),
    "--lr-warmup-iters": (INT, 0),
    "--lr-warmup-fraction": (FLOAT, None),
    "--lr-decay-iters": (INT, None),
    "--lr-wsd-decay-iters": (INT, None),
    "--lr-wsd-decay-style": (ENUM, None),
    "--use-checkpoint-lr-scheduler": (BOOL, True),
    "--override-lr-scheduler": (BOOL, False),
    "--seed": (INT, 1234),
    # Rollout
    "--hf-checkpoint": (PATH, None),
    "--diffusion-model-family": (STR, None),
    "--rollout-function-path": (DOTTED, "miles.rollout.sglang_rollout.generate_rollout"),
    "--train-pipeline-config-path": (DOTTED, None),
    "--model-backend-path": (DOTTED, None),
    "--diffusion-num-steps": (INT, 10),
    "--diffusion-flow-shift": (FLOAT, None),
    "--rollout-microgroup-size": (INT, 1),
    "--diffusion-fps": (FLOAT, None),
    "--diffusion-output-num-frames": (INT, 1),
    "--diffusion-guidance-scale": (FLOAT, 4.0),
    "--diffusion-guidance-scale-2": (FLOAT, None),
    "--diffusion-true-cfg-scale": (FLOAT, None),
    "--diffusion-negative-prompt": (STR, None),
    "--diffusion-noise-level": (FLOAT, 0.7),
    "--diffusion-height": (INT, 512),
    "--diffusion-width": (INT, 512),
    "--diffusion-sde-type": (ENUM, "sde"),
    "--sde-step-backend-path": (DOTTED, None),
    "--diffusion-num-sde-steps": (INT, 0),
    "--diffusion-sde-window-range": (INT_RANGE, None),
    "--diffusion-sde-candidate-steps": (INT_LIST, None),
    "--diffusion-step-strategy-path": (DOTTED, None),
    "--diffusion-log-prob-no-const": (BOOL, False),
    "--diffusion-generator-device": (STR, "cuda"),
    "--rollout-patch-group": (STR_LIST, None),
    "--update-weight-target-module": (STR_LIST, ["transformer"]),
    "--update-weight-buffer-size": (INT, 536870912),
    "--rollout-seed": (INT, 42),
    "--over-sampling-batch-size": (INT, None),
    "--sglang-server-concurrency": (INT, 512),
    "--use-distributed-post": (BOOL, False),
    "--use-miles-router": (BOOL, False),
    "--miles-router-timeout": (FLOAT, None),
    "--miles-router-max-connections": (INT, None),
    "--miles-router-health-check-failure-threshold": (INT, 3),
    # Data and batching
    "--prompt-data": (PATH, None),
    "--input-key": (STR, "input"),
    "--metadata-key": (STR, "metadata"),
    "--data-source-path": (DOTTED, None),
    "--disable-rollout-global-dataset": (BOOL, False),
    "--rollout-batch-size": (INT, None),
    "--n-samples-per-prompt": (INT, 1),
    "--global-batch-size": (INT, None),
    "--num-steps-per-rollout": (INT, None),
    "--micro-batch-size": (INT, 1),
    "--micro-batch-size-sample": (INT, None),
    "--micro-batch-size-tstep": (INT, None),
    "--diffusion-train-iter-order": (ENUM, "sample_major"),
    "--train-dp-split-mode": (ENUM, "contiguous"),
    "--num-rollout": (INT, None),
    "--num-epoch": (INT, None),
    "--start-rollout-id": (INT, None),
    "--sft-encoder-checkpoint": (PATH, None),
    "--sft-frame-stride": (INT, 1),
    # Evaluation
    "--eval-interval": (INT, None),
    "--eval-prompt-data": (NAMED_PATHS, None),
    "--eval-config": (PATH, None),
    "--eval-function-path": (DOTTED, None),
    "--eval-input-key": (STR, None),
    "--n-samples-per-eval-prompt": (INT, 1),
    "--diffusion-eval-num-steps": (INT, None),
    "--skip-eval-before-train": (BOOL, False),
    "--eval-reward-key": (STR, None),
    # Algorithm and loss
    "--loss-type": (ENUM, None),
    "--advantage-estimator": (ENUM, "grpo"),
    "--disable-grpo-std-normalization": (BOOL, False),
    "--globalize-reward-mean": (BOOL, False),
    "--globalize-reward-std": (BOOL, False),
    "--diffusion-clip-range": (FLOAT, 1e-4),
    "--diffusion-adv-clip-max": (FLOAT, 5.0),
    "--diffusion-recompute-old-log-prob": (BOOL, False),
    "--diffusion-kl-beta": (FLOAT, 0.0),
    "--ref-mode": (ENUM, None),
    "--custom-prepare-train-batch-path": (DOTTED, None),
    "--custom-loss-function-path": (DOTTED, None),
    "--diffusion-nft-beta": (FLOAT, 1.0),
    "--diffusion-nft-timestep-fraction": (FLOAT, 0.99),
    "--no-diffusion-nft-adaptive-weight": (BOOL, False),
    "--no-diffusion-nft-shuffle-timesteps": (BOOL, False),
    # Reward
    "--rm-type": (STR_LIST, None),  # the reference's enum, made a list for several weighted rewards
    "--reward-key": (STR, None),
    "--group-rm": (BOOL, False),
    "--custom-rm-path": (DOTTED, None),
    "--custom-reward-post-process-path": (DOTTED, None),
    "--colocate-reward": (BOOL, False),
    "--pickscore-model-path": (PATH, None),
    "--pickscore-processor-path": (PATH, None),
    "--pickscore-num-workers": (INT, 1),
    "--pickscore-num-gpus-per-worker": (FLOAT, 1.0),
    "--pickscore-batch-size": (INT, 8),
    "--pickscore-num-frames": (INT, None),
    "--ocr-num-workers": (INT, 4),
    "--rollout-parser-num-workers": (INT, 1),
    # Rollout customization hooks
    "--custom-generate-function-path": (DOTTED, None),
    "--dynamic-sampling-filter-path": (DOTTED, None),
    "--rollout-sample-filter-path": (DOTTED, None),
    "--buffer-filter-path": (DOTTED, None),
    "--custom-convert-samples-to-train-data-path": (DOTTED, None),
    "--custom-expand-samples-to-train-pairs-path": (DOTTED, None),
    "--custom-rollout-log-function-path": (DOTTED, None),
    "--custom-eval-rollout-log-function-path": (DOTTED, None),
    # LoRA
    "--use-lora": (BOOL, False),
    "--lora-rank": (INT, 64),
    "--lora-alpha": (INT, 64),
    "--lora-target-modules": (STR_LIST, None),
    "--lora-init-weights": (STR, "gaussian"),
    "--lora-ipc-weight-sync": (BOOL, False),
    # EMA
    "--use-ema": (BOOL, False),
    "--ema-rollout-policy": (ENUM, "live"),
    "--ema-decay-init": (FLOAT, 0.001),
    "--ema-decay-ramp": (FLOAT, 0.001),
    "--ema-decay-max": (FLOAT, 0.5),
    "--ema-decay-flat-steps": (INT, 0),
    # Checkpointing
    "--save": (PATH, None),
    "--save-interval": (INT, None),
    "--no-save-optim": (BOOL, False),
    "--load": (PATH, None),
    "--ckpt-step": (INT, None),
    "--no-load-optim": (BOOL, False),
    "--no-load-rng": (BOOL, False),
    # Logging
    "--use-wandb": (BOOL, False),
    "--wandb-project": (STR, None),
    "--wandb-group": (STR, None),
    "--wandb-run-id": (STR, None),
    "--wandb-team": (STR, None),
    "--wandb-host": (STR, None),
    "--wandb-key": (STR, None),
    "--wandb-mode": (ENUM, None),
    "--wandb-dir": (PATH, "./wandb"),
    "--disable-wandb-random-suffix": (BOOL, False),
    "--wandb-log-num-images": (INT, 0),
    "--wandb-log-image-interval": (INT, 1),
    "--use-miles-dashboard": (BOOL, False),
    "--miles-dashboard-workspace": (PATH, "./miles_dashboard"),
    # Fault tolerance
    "--use-fault-tolerance": (BOOL, False),
    "--rollout-health-check-interval": (FLOAT, 30.0),
    "--rollout-health-check-timeout": (FLOAT, 30.0),
    "--rollout-health-check-first-wait": (FLOAT, 0.0),
    # Debugging
    "--debug-rollout-only": (BOOL, False),
    "--train-only": (BOOL, False),
    "--debug-skip-optimizer-step": (BOOL, False),
    "--save-debug-rollout-data": (PATH, None),
    "--load-debug-rollout-data": (PATH, None),
    "--load-debug-rollout-data-subsample": (FLOAT, None),
    "--save-debug-train-data": (PATH, None),
    "--dump-details": (PATH, None),
    "--diffusion-debug-mode": (BOOL, False),
    # CI
    "--ci-test": (BOOL, False),
    "--ci-metric-checker-key": (STR, None),
    "--ci-metric-checker-threshold": (FLOAT, None),
}

# Flags miles adds on top of the reference.
MILES_ADDITIONS: dict[str, tuple[str, object]] = {
    "--custom-config-path": (PATH, None),
    "--output-dir": (PATH, None),
    "--verbose": (BOOL, False),
    "--hook-timeout": (FLOAT, 1800.0),
    "--gpu-memory-gib": (FLOAT, None),
    "--rm-url": (STR, None),
    "--reward-weights": (WEIGHTS, None),
    "--reward-component-norm": (ENUM, "none"),
    "--rm-remote-name": (STR, None),
    "--rm-batch-size": (INT, 32),
    "--rm-max-in-flight": (INT, 4),
    "--rm-timeout": (FLOAT, 60.0),
    "--rm-retries": (INT, 3),
    "--rm-fault-wait": (FLOAT, 120.0),
    "--clip-score-model-path": (PATH, None),
    "--clip-score-processor-path": (PATH, None),
    "--clip-score-scale": (FLOAT, 100.0 / 30.0),
    "--aesthetic-model-path": (PATH, None),
    "--aesthetic-clip-path": (PATH, None),
    "--hps-model-path": (PATH, None),
    "--hps-tokenizer-path": (PATH, None),
    "--image-reward-model-path": (PATH, None),
    "--image-reward-tokenizer-path": (PATH, None),
    "--vlm-judge-url": (STR, None),
    "--vlm-judge-model": (STR, None),
    "--vlm-judge-prompt-template": (STR, None),
    "--vlm-judge-score-pattern": (STR, None),
    "--vlm-judge-max-score": (FLOAT, 5.0),
    "--vlm-judge-num-frames": (INT, None),
    "--vlm-judge-max-concurrency": (INT, 8),
    "--vlm-judge-edit-prompt-template": (STR, None),
    "--vlm-judge-edit-max-score": (FLOAT, 4.0),
    "--vlm-judge-edit-quality-weight": (FLOAT, 0.5),
    "--dino-model-path": (PATH, None),
    "--source-reward-num-frames": (INT, None),
    "--export-interval": (INT, None),
    "--export-merged": (BOOL, False),
    "--teacher-checkpoint": (PATH, None),
    "--dmd2-student-timesteps": (INT_LIST, [999, 749, 499, 249]),
    "--dmd2-real-guidance-scale": (FLOAT, None),
    "--dmd2-critic-update-ratio": (INT, 5),
    "--dmd2-min-step-ratio": (FLOAT, 0.02),
    "--dmd2-max-step-ratio": (FLOAT, 0.98),
    "--dmd2-gan-loss-weight": (FLOAT, 0.0),
    "--dmd2-backward-simulation": (BOOL, True),
    "--use-tensorboard": (BOOL, False),
    "--tensorboard-dir": (PATH, None),
    "--rollout-backend": (ENUM, "auto"),
    "--rollout-num-engines": (INT, None),
    "--sglang-python": (PATH, None),
    "--rollout-engine-host": (STR, "auto"),
    # issue 45: several hosts
    "--max-engine-restarts": (INT, 3),
    "--rollout-manager-node": (STR, "driver"),
    "--host-timeout": (FLOAT, 30.0),
    # issue 46: engine forwards sized for the device
    "--rollout-engine-batch-size": (INT, None),
    "--sglang-start-timeout": (FLOAT, 600.0),
    # issue 32: GRPO-Guard, Flow-GRPO-Fast's shared prefix, MixGRPO's window, solver and compressed schedule
    "--diffusion-grpo-guard": (BOOL, False),
    "--diffusion-sde-window-interval": (INT, 25),
    "--diffusion-sde-window-stride": (INT, 1),
    "--diffusion-shared-prefix": (BOOL, False),
    "--diffusion-ode-solver": (ENUM, "euler"),
    "--diffusion-post-sde-steps-ratio": (FLOAT, None),
    # issue 46: flow_grpo's detached unconditional branch in the trained CFG forward
    "--diffusion-cfg-uncond-grad": (ENUM, "full"),
    # Diffusion-DPO (--loss-type dpo): online and offline
    "--diffusion-dpo-beta": (FLOAT, 100.0),
    "--diffusion-dpo-num-timesteps": (INT, 1),
    "--chosen-key": (STR, "chosen"),
    "--rejected-key": (STR, "rejected"),
    # issue 32: the gold reward and the reward-hacking guard
    "--gold-rm-type": (STR, None),
    "--gold-reward-key": (STR, None),
    "--reward-guard": (ENUM, "off"),
    "--reward-guard-patience": (INT, 2),
    "--reward-guard-tolerance": (FLOAT, 0.0),
    "--reward-guard-min-diversity": (FLOAT, None),
    # issue 49: condition media on data rows
    "--media-key": (STR, "media"),
    "--eval-media-key": (STR, None),
}

EXPECTED_GROUPS = (
    "Job",
    "Cluster",
    "Training backend",
    "Optimizer and schedule",
    "Rollout",
    "Data and batching",
    "Evaluation",
    "Algorithm and loss",
    "Reward",
    "Rollout customization hooks",
    "LoRA",
    "EMA",
    "Checkpointing",
    "Logging",
    "Fault tolerance",
    "Debugging",
    "CI",
    "DMD2",
)


def test_fixture_covers_the_reference() -> None:
    assert len(FIXTURE) >= 190
    assert not set(FIXTURE) & set(MILES_ADDITIONS)


@pytest.mark.parametrize("option", sorted({**FIXTURE, **MILES_ADDITIONS}))
def test_flag_kind_and_default(option: str) -> None:
    kind, default = {**FIXTURE, **MILES_ADDITIONS}[option]
    flag = flag_for(option)
    assert flag is not None, f"{option} is missing from the catalogue"
    assert flag.option == option
    assert flag.kind == kind
    assert flag.default == default
    if default is not None:
        assert type(flag.default) is type(default)


def test_no_flags_beyond_the_reference_and_the_additions() -> None:
    options = {flag.option for flag in ALL_FLAGS}
    assert options - set(FIXTURE) - set(MILES_ADDITIONS) == set()
    assert len(ALL_FLAGS) == len(FIXTURE) + len(MILES_ADDITIONS)


def test_groups_in_reference_order() -> None:
    assert GROUPS == EXPECTED_GROUPS
    seen = [flag.group for flag in ALL_FLAGS]
    # Flags come panel by panel, in GROUPS order.
    assert sorted(seen, key=GROUPS.index) == seen
    assert set(seen) == set(GROUPS)


def test_dests_unique_and_indexed() -> None:
    dests = [flag.dest for flag in ALL_FLAGS]
    assert len(dests) == len(set(dests))
    for flag in ALL_FLAGS:
        assert FLAGS_BY_DEST[flag.dest] is flag
        for alias in flag.aliases:
            assert FLAGS_BY_DEST[alias.replace("-", "_")] is flag


def test_every_flag_has_help_and_a_group() -> None:
    for flag in ALL_FLAGS:
        assert flag.help.strip(), f"--{flag.name} has no help"
        assert flag.group in GROUPS


def test_flag_for_spellings_and_aliases() -> None:
    flag = flag_for("--rollout-batch-size")
    assert flag is not None
    assert flag_for("rollout-batch-size") is flag
    assert flag_for("rollout_batch_size") is flag
    alias = flag_for("--debug-train-only")
    assert alias is not None and alias.dest == "train_only"
    assert flag_for("debug_train_only") is alias
    assert flag_for("--no-such-flag") is None


def test_enum_defaults_in_choices() -> None:
    enums = [flag for flag in ALL_FLAGS if flag.kind == ENUM]
    assert enums
    for flag in enums:
        assert flag.choices
        assert flag.default is None or flag.default in flag.choices


def test_enum_choices() -> None:
    def choices(option: str) -> tuple[str, ...] | None:
        flag = flag_for(option)
        assert flag is not None
        return flag.choices

    assert choices("--loss-type") == ("policy_loss", "nft", "sft_loss", "custom_loss", "dpo", "dmd2", "dmd2_critic")
    assert choices("--lr-decay-style") == ("constant", "linear", "cosine", "inverse-square-root", "WSD")
    assert choices("--diffusion-sde-type") == ("sde", "cps", "ode")
    assert choices("--ref-mode") == ("none", "lora_base", "ema", "frozen")
    assert choices("--diffusion-cfg-uncond-grad") == ("full", "detach")
    assert choices("--wandb-mode") == ("online", "offline", "disabled")
    assert set(choices("--rm-type") or ()) == {
        "digit",
        "ocr",
        "pickscore",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "clip_score",
        "aesthetic",
        "hpsv2",
        "image_reward",
        "vlm_judge",
        "clip_i",
        "clip_directional",
        "dino_i",
        "vlm_judge_edit",
        "digit_edit",
        "digit_i2v",
        "remote_rm",
    }
    assert choices("--rollout-patch-group") == ("sgld", "ltx", "wan")
    for option in ("--fsdp-master-dtype", "--fsdp-reduce-dtype", "--diffusion-forward-dtype"):
        assert set(choices(option) or ()) == {"fp32", "bf16", "fp16"}


def test_job_scopes() -> None:
    def jobs(option: str) -> frozenset[str] | None:
        flag = flag_for(option)
        assert flag is not None
        return flag.jobs

    for flag in ALL_FLAGS:
        if flag.group == "DMD2":
            assert flag.jobs == frozenset({"dmd2"})
    assert jobs("--teacher-checkpoint") == frozenset({"dmd2"})
    for option in (
        "--diffusion-nft-beta",
        "--diffusion-nft-timestep-fraction",
        "--no-diffusion-nft-adaptive-weight",
        "--no-diffusion-nft-shuffle-timesteps",
    ):
        assert jobs(option) == frozenset({"rl", "replay"})
    assert jobs("--sft-encoder-checkpoint") == frozenset({"sft"})
    assert jobs("--sft-frame-stride") == frozenset({"sft"})
    assert jobs("--lr") is None


def test_negative_spellings() -> None:
    no_save = flag_for("--no-save-optim")
    assert no_save is not None and no_save.dest == "no_save_optim"
    backward = flag_for("--dmd2-backward-simulation")
    assert backward is not None and backward.negative_option() == "--no-dmd2-backward-simulation"


def _parse(option: str, raw: object) -> object:
    flag = flag_for(option)
    assert flag is not None
    return flag.parse(raw, option)


@pytest.mark.parametrize(
    ("option", "raw", "expected"),
    [
        ("--rollout-batch-size", "32", 32),
        ("--update-weight-buffer-size", "2e9", 2_000_000_000),
        ("--lr", "1e-5", 1e-5),
        ("--diffusion-model-family", "sd3", "sd3"),
        ("--colocate", "true", True),
        ("--offload-train", "off", False),
        ("--fsdp-master-dtype", "bf16", "bf16"),
        ("--train-env-vars", '{"NCCL_DEBUG": "INFO"}', {"NCCL_DEBUG": "INFO"}),
        ("--diffusion-sde-window-range", "0,10", [0, 10]),
        ("--diffusion-sde-candidate-steps", "1,2,3", [1, 2, 3]),
        ("--lora-target-modules", "to_q,to_k", ["to_q", "to_k"]),
        ("--rollout-patch-group", "sgld,wan", ["sgld", "wan"]),
        ("--eval-prompt-data", "test a.jsonl val b.jsonl", {"test": "a.jsonl", "val": "b.jsonl"}),
        ("--custom-rm-path", "my_pkg.rewards.rm", "my_pkg.rewards.rm"),
        ("--save", "/tmp/ckpt", "/tmp/ckpt"),
        ("--dmd2-student-timesteps", "999,499", [999, 499]),
    ],
)
def test_parse_good_values(option: str, raw: object, expected: object) -> None:
    assert _parse(option, raw) == expected


@pytest.mark.parametrize(
    ("option", "raw"),
    [
        ("--rollout-batch-size", "many"),
        ("--rollout-batch-size", "0"),
        ("--lr", "fast"),
        ("--lr", "-1"),
        ("--colocate", "maybe"),
        ("--fsdp-master-dtype", "fp8"),
        ("--train-env-vars", "[1, 2]"),
        ("--train-env-vars", "{not json"),
        ("--diffusion-sde-window-range", "10,0"),
        ("--diffusion-sde-window-range", "1,2,3"),
        ("--diffusion-sde-candidate-steps", "a,b"),
        ("--rollout-patch-group", "sgld,nope"),
        ("--eval-prompt-data", "only-a-name"),
        ("--custom-rm-path", "not a path"),
        ("--diffusion-nft-timestep-fraction", "1.5"),
        ("--ema-decay-max", "2"),
        ("--diffusion-num-sde-steps", "-1"),
        ("--dmd2-student-timesteps", "1000,500"),
    ],
)
def test_parse_bad_values(option: str, raw: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _parse(option, raw)
    assert option in str(excinfo.value)


def test_import_is_light() -> None:
    code = (
        "import sys, miles.config.catalog\n"
        "heavy = [m for m in ('torch', 'ray', 'typer', 'yaml', 'rich', 'pydantic') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    assert result.stdout.strip() == ""


def test_catalogue_exports() -> None:
    assert catalog.ALL_FLAGS is ALL_FLAGS
    assert all(len(catalog.FLAGS_BY_GROUP[group]) for group in GROUPS)
