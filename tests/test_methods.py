"""The method table (`miles.methods`) is the one list of loss types: the flag's choices, each job's allowed and
auto loss types, the rollout-pair rule, the automatic --ref-mode, DMD2's critic group, the trainer's method object
and the memory plan all read it."""

from __future__ import annotations

from miles.config.catalog import FLAGS_BY_DEST
from miles.config.jobs import JOBS
from miles.config.resolve import resolve
from miles.config.rules.algorithm import ROLLOUT_LOSSES
from miles.methods import LOSS_TYPES, METHODS, auto_loss_type, loss_types_for, rollout_loss_types


def test_the_flag_and_the_jobs_read_the_table() -> None:
    assert tuple(FLAGS_BY_DEST["loss_type"].choices) == LOSS_TYPES == tuple(METHODS)
    for name, job in JOBS.items():
        assert job.allowed_loss_types == loss_types_for(name)
        assert job.auto_loss_type == auto_loss_type(name)
    assert JOBS["rl"].allowed_loss_types == ("policy_loss", "nft", "custom_loss", "dpo")
    assert JOBS["sft"].allowed_loss_types == ("sft_loss", "custom_loss", "dpo")
    assert JOBS["replay"].allowed_loss_types == ("policy_loss", "nft", "custom_loss", "dpo")
    assert ROLLOUT_LOSSES == rollout_loss_types() == ("policy_loss", "nft", "custom_loss", "dpo")


def test_each_method_resolves_as_its_entry_says() -> None:
    nft = resolve(
        "rl", recipe="tiny-digits-grpo", cli={"loss_type": "nft", "diffusion_sde_type": "ode", "use_ema": True}
    ).args
    assert nft.ref_mode == METHODS["nft"].ref_mode == "ema"
    grpo = resolve("rl", recipe="tiny-digits-grpo").args
    assert grpo.loss_type == "policy_loss" and grpo.ref_mode == "none"
    # dpo: one entry, two automatic references (the LoRA base under --use-lora, else a frozen copy)
    assert METHODS["dpo"].auto_ref_mode(use_lora=False) == "frozen"
    assert METHODS["dpo"].auto_ref_mode(use_lora=True) == "lora_base"
    assert resolve("rl", recipe="tiny-digits-dpo").args.ref_mode == "frozen"
    assert resolve("rl", recipe="tiny-digits-dpo", cli={"use_lora": True}).args.ref_mode == "lora_base"
    assert resolve("sft", recipe="tiny-digits-dpo-offline", cli={"use_lora": True}).args.ref_mode == "lora_base"
    assert resolve("rl", recipe="tiny-digits-dpo", cli={"ref_mode": "lora_base", "use_lora": True}).args.ref_mode == (
        "lora_base"
    )


def test_every_method_names_a_train_method_with_the_entry_points_its_jobs_call() -> None:
    """The trainer builds `impl` (miles.training.methods): rollout methods give pairs and a micro-step, the methods
    of `train sft` a dataset loss (flow matching's by default), DMD2's a `train` of their own."""
    from miles.training.methods.base import RolloutMethod, TrainMethod
    from miles.utils.hooks import load_class

    for m in METHODS.values():
        cls = load_class(m.impl, "--loss-type")
        assert issubclass(cls, TrainMethod), m.name
        assert issubclass(cls, RolloutMethod) == m.on_rollouts, m.name
        if m.on_rollouts:
            assert cls.pairs is not RolloutMethod.pairs and cls.micro is not RolloutMethod.micro, m.name
        if not m.on_rollouts and "sft" not in m.jobs:
            assert cls.train is not TrainMethod.train, m.name
    assert METHODS["dmd2"].critic == "dmd2_critic" and METHODS["dmd2_critic"].frozen_teacher
    assert load_class(METHODS["custom_loss"].impl, "").data_loss is not TrainMethod.data_loss


def test_every_rules_name_is_a_rule_function() -> None:
    from miles.config.rules.methods import RULE_FUNCTIONS

    named = {m.rules for m in METHODS.values() if m.rules is not None}
    assert named and named <= set(RULE_FUNCTIONS)


def test_a_methods_own_flags_are_refused_under_another_method() -> None:
    """`own_flags` in the table: one generic rule, the same line for each method's flags."""
    import pytest

    from miles.core.errors import ConfigError

    base = {"loss_type": "nft", "diffusion_sde_type": "ode", "use_ema": True}
    for dest, value, owner in (
        ("diffusion_recompute_old_log_prob", True, "policy_loss"),
        ("custom_loss_function_path", "my.loss", "custom_loss"),
        ("diffusion_dpo_beta", 500.0, "dpo"),
        ("diffusion_dpo_num_timesteps", 4, "dpo"),
    ):
        assert dest in METHODS[owner].own_flags
        with pytest.raises(ConfigError, match=rf"applies to --loss-type {owner} only, not nft"):
            resolve("rl", recipe="tiny-digits-grpo", cli={**base, dest: value})


def test_dpos_data_flags_are_refused_under_another_method_of_train_sft() -> None:
    import pytest

    from miles.core.errors import ConfigError

    assert METHODS["dpo"].sft_rows == "preference" and METHODS["sft_loss"].sft_rows == "image"
    for dest in ("chosen_key", "rejected_key"):
        assert dest in METHODS["dpo"].own_flags
        with pytest.raises(ConfigError, match=r"applies to --loss-type dpo only, not sft_loss"):
            resolve("sft", recipe="tiny-digits-sft", cli={dest: "better"})
    args = resolve("sft", recipe="tiny-digits-dpo-offline", cli={"chosen_key": "a", "rejected_key": "b"}).args
    assert (args.chosen_key, args.rejected_key) == ("a", "b")
