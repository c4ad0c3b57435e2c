"""Rules of the trainer's hooks: each is accepted only where the trainer calls it (torch-free)."""

from __future__ import annotations

from typing import Any

import pytest
from jobs_helpers import assert_names, rejected, run

HOOK = "my_hooks.fn"


@pytest.mark.parametrize("dest", ["custom_loss_function_path", "custom_prepare_train_batch_path"])
def test_loss_hooks_need_custom_loss(dest: str) -> None:
    message = rejected(**{dest: HOOK})
    assert_names(message, f"--{dest.replace('_', '-')} {HOOK} (cli)", "--loss-type custom_loss only", "policy_loss")


def test_custom_loss_with_its_hooks() -> None:
    args = run(loss_type="custom_loss", custom_loss_function_path=HOOK, custom_prepare_train_batch_path=HOOK).args
    assert args.custom_prepare_train_batch_path == HOOK


@pytest.mark.parametrize(
    "extra",
    [
        {"loss_type": "policy_loss"},
        {"loss_type": "nft", "use_ema": True},
        {"loss_type": "custom_loss", "custom_loss_function_path": HOOK},
    ],
    ids=["policy_loss", "nft", "custom_loss"],
)
@pytest.mark.parametrize(
    "dest", ["custom_convert_samples_to_train_data_path", "custom_expand_samples_to_train_pairs_path"]
)
def test_pair_hooks_apply_to_every_rollout_loss(dest: str, extra: dict[str, Any]) -> None:
    assert getattr(run(**extra, **{dest: HOOK}).args, dest) == HOOK
    assert getattr(run("replay", **extra, **{dest: HOOK}).args, dest) == HOOK


@pytest.mark.parametrize(
    "dest",
    [
        "custom_convert_samples_to_train_data_path",
        "custom_expand_samples_to_train_pairs_path",
        "custom_prepare_train_batch_path",
    ],
)
def test_train_sft_has_no_rollout_pairs_for_the_pair_hooks(dest: str) -> None:
    message = rejected("sft", loss_type="custom_loss", custom_loss_function_path=HOOK, **{dest: HOOK})
    assert_names(message, f"--{dest.replace('_', '-')} {HOOK} (cli)", "`miles train sft`", "custom_loss")


def test_train_sft_takes_a_custom_loss() -> None:
    assert run("sft", loss_type="custom_loss", custom_loss_function_path=HOOK).args.loss_type == "custom_loss"
