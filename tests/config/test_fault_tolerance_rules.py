"""Health-check and fault-tolerance flags: values that mean nothing are refused in one line (fast, torch-free)."""

from __future__ import annotations

import pytest
from jobs_helpers import assert_names, rejected, run

from miles_cli.main import main


def test_health_check_flags_resolve() -> None:
    args = run(
        use_fault_tolerance=True,
        rollout_health_check_interval=2.0,
        rollout_health_check_timeout=1.5,
        rollout_health_check_first_wait=10.0,
    ).args
    assert (args.use_fault_tolerance, args.rollout_health_check_interval) == (True, 2.0)
    assert (args.rollout_health_check_timeout, args.rollout_health_check_first_wait) == (1.5, 10.0)
    assert run(rollout_health_check_interval=0).args.rollout_health_check_interval == 0  # checks off


def test_a_zero_health_check_timeout_is_refused() -> None:
    message = rejected(rollout_health_check_timeout=0)
    assert_names(message, "--rollout-health-check-timeout 0", "positive number of seconds")


def test_first_wait_without_health_checks_is_refused() -> None:
    message = rejected(rollout_health_check_interval=0, rollout_health_check_first_wait=30.0)
    assert_names(message, "--rollout-health-check-first-wait 30.0", "--rollout-health-check-interval 0", "turns off")


@pytest.mark.parametrize("job", ["sft", "replay"])
def test_fault_tolerance_without_engines_is_refused(job: str) -> None:
    message = rejected(job, use_fault_tolerance=True)
    assert_names(message, "--use-fault-tolerance on (cli)", f"`miles {job.replace('sft', 'train sft')}`", "no rollout")


def test_fault_tolerance_on_saved_rollouts_is_refused() -> None:
    message = rejected(use_fault_tolerance=True, load_debug_rollout_data="r{rollout_id}.pt")
    assert_names(message, "--use-fault-tolerance on", "--load-debug-rollout-data")


def test_the_cli_refuses_with_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect-config", "--recipe", "tiny-digits-grpo", "--rollout-health-check-timeout", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--rollout-health-check-timeout 0" in err
