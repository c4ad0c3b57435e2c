"""Rules of the rollout hooks and backends: each is accepted only where miles calls it (torch-free)."""

from __future__ import annotations

import pytest
from jobs_helpers import assert_names, rejected, run

HOOK = "my_hooks.fn"


@pytest.mark.parametrize(
    "name",
    ["miles.rollout.sglang_rollout.generate_rollout", "miles.rollout.sglang_diffusion_rollout.generate_rollout"],
)
def test_reference_rollout_names_are_the_builtin_rollout(name: str) -> None:
    assert run(rollout_function_path=name).args.rollout_function_path == name
    assert run("sft", rollout_function_path=name).args.rollout_function_path == name  # no hook: nothing to refuse


def test_unknown_miles_rollout_path_is_refused() -> None:
    message = rejected(rollout_function_path="miles.rollout.sglang_rollout.generate")
    assert_names(message, "--rollout-function-path miles.rollout.sglang_rollout.generate (cli)", "not a miles rollout")


@pytest.mark.parametrize(
    ("job", "dest"),
    [
        ("sft", "rollout_function_path"),
        ("replay", "rollout_function_path"),
        ("dmd2", "rollout_function_path"),
        ("rollout-only", "eval_function_path"),
        ("dmd2", "custom_generate_function_path"),
        ("sft", "custom_rollout_log_function_path"),
        ("eval", "custom_rollout_log_function_path"),
        ("rollout-only", "custom_eval_rollout_log_function_path"),
        ("eval", "model_backend_path"),
        ("rollout-only", "model_backend_path"),
        ("eval", "sde_step_backend_path"),
        ("sft", "sde_step_backend_path"),
    ],
)
def test_hooks_refused_where_nothing_calls_them(job: str, dest: str) -> None:
    message = rejected(job, **{dest: HOOK})
    assert_names(message, f"--{dest.replace('_', '-')} {HOOK} (cli)", "applies to", "does not run")


@pytest.mark.parametrize(
    "dest",
    [
        "rollout_function_path",
        "eval_function_path",
        "custom_generate_function_path",
        "custom_rollout_log_function_path",
        "custom_eval_rollout_log_function_path",
        "model_backend_path",
        "sde_step_backend_path",
    ],
)
def test_hooks_accepted_in_train_rl(dest: str) -> None:
    assert getattr(run(rollout_backend="diffusers", **{dest: HOOK}).args, dest) == HOOK


def test_buffer_filter_needs_a_data_source_that_fills_the_buffer() -> None:
    message = rejected(buffer_filter_path=HOOK)
    assert_names(message, f"--buffer-filter-path {HOOK} (cli)", "nothing puts groups back", "--data-source-path")
    assert run(buffer_filter_path=HOOK, data_source_path="my_hooks.Source").args.buffer_filter_path == HOOK


@pytest.mark.parametrize(("dest", "value"), [("sde_step_backend_path", HOOK), ("diffusion_log_prob_no_const", True)])
def test_engine_side_log_prob_knobs_refused_on_sglang(dest: str, value: object) -> None:
    message = rejected(rollout_backend="sglang", **{dest: value})
    assert_names(message, "--rollout-backend sglang", "computes its own log-probs")
    assert getattr(run(rollout_backend="diffusers", **{dest: value}).args, dest) == value


@pytest.mark.parametrize(
    ("dest", "value", "why"),
    [
        ("diffusion_grpo_guard", True, "does not return"),
        ("diffusion_shared_prefix", True, "its own seed on its own schedule"),
        ("diffusion_post_sde_steps_ratio", 0.4, "its own seed on its own schedule"),
        ("diffusion_ode_solver", "dpmpp_2m", "its scheduler's"),
        ("rollout_engine_batch_size", 32, "batches the requests it is sent itself"),
    ],
)
def test_diffusers_engine_sampling_plans_refused_on_sglang(dest: str, value: object, why: str) -> None:
    group = {"rollout_microgroup_size": 4}  # a shared prefix needs microgroups of several samples
    message = rejected(rollout_backend="sglang", **group, **{dest: value})
    assert_names(message, "--rollout-backend sglang", why, "use --rollout-backend diffusers")
    assert getattr(run(rollout_backend="diffusers", **group, **{dest: value}).args, dest) == value


def test_a_recipes_engine_batch_size_is_dropped_under_sglang() -> None:
    """tiny-digits-grpo sizes its CPU engine's forwards (--rollout-engine-batch-size 32); served by sglang the
    recipe still runs, the value derived away (an sglang server batches itself); typed by the user it is refused."""
    import sys

    from miles.config.resolve import resolve

    sglang = {"rollout_backend": "sglang", "sglang_python": sys.executable}
    assert resolve("rl", recipe="tiny-digits-grpo").args.rollout_engine_batch_size == 32
    served = resolve("rl", recipe="tiny-digits-grpo", cli=sglang).args
    assert served.rollout_engine_batch_size is None
    assert served.source_of("rollout_engine_batch_size") == "derived"
