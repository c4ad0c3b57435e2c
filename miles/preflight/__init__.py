"""The preflight: every input of a resolved job, checked in the driver before Ray starts, every problem at once.

`miles train|eval|rollout-only|replay` runs it after printing the args and before anything starts (no Ray, no
model build); `miles inspect-config --check` runs it alone. Each check is a small function of the resolved job
in a module with one job (models, data, hooks, checkpoint, cluster, memory, replay, several hosts), registered once
in `CHECKS` with the jobs it applies to; each returns one line per problem, naming the flag, the value, what is
wrong and what to do, or a `PreflightWarning` line for what it can only warn about (printed as
`miles: warning: ...` and counted in the summary, refusing nothing). Torch- and Ray-free, except the hook check (it
imports your hook modules), the rollout-file check (it loads the rollout a replay trains on) and `--eval-config`
(read by `miles.rollout.evaluation.eval_datasets`).

    find_problems(resolved) -> list[str]        every problem, one line each
    preflight(resolved) -> None                 ConfigError: the problem, or "N problems:" and one per line
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

from miles.core.errors import ConfigError
from miles.preflight import checkpoint, cluster, data, hooks, memory, models, replay, rewards, several_hosts
from miles.preflight.base import Check, PreflightWarning
from miles.utils.text import first_line

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

CHECKS: tuple[Check, ...] = (
    Check("model paths", models.check_model_paths),
    Check("prompt data", data.check_prompt_data, applies_to=attrgetter("needs_prompt_data")),
    Check("eval data", data.check_eval_data),
    Check("hooks", hooks.check_hooks),
    # a job that starts engines scores with the reward: its rollouts, or its eval samples
    Check("reward service", rewards.check_remote_reward, applies_to=attrgetter("starts_engines")),
    Check("--load", checkpoint.check_load, applies_to=attrgetter("saves_checkpoints")),
    Check("--save", checkpoint.check_save_over_checkpoints, applies_to=attrgetter("saves_checkpoints")),
    Check("output folders", checkpoint.check_outputs),
    Check("finished runs", checkpoint.check_finished_runs),
    Check("cluster", cluster.check_cluster),
    Check("GPU memory", memory.check_gpu_memory),
    Check("rollout files", replay.check_rollout_files, applies_to=attrgetter("trains_on_rollouts")),
    Check("several hosts", several_hosts.check_several_hosts),
)


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    checks: int = 0  # how many checks ran
    warnings: int = 0  # the config rules' warnings (printed before the preflight runs) and the checks' own
    warned: list[str] = field(default_factory=list)  # the checks' warnings (PreflightWarning lines), as printed
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)  # checks that crashed (a bug in miles): their warning lines


def run_checks(resolved: ResolvedJob, checks: tuple[Check, ...] = CHECKS) -> Report:
    """Run every check that applies to the job. A mistake in the inputs is a problem line (every check turns
    what it meets into one); a check that still crashes is a bug in the check, not a verdict on the input: it is
    warned about on stderr (and kept in `Report.failed`), and the job is not refused for it, since nothing would
    let the user past a refusal they cannot fix; the runtime still reads that input with the same readers."""
    start = time.perf_counter()
    report = Report(warnings=len(resolved.warnings))
    for check in checks:
        if not check.applies(resolved.spec):
            continue
        report.checks += 1
        try:
            for line in check.run(resolved):
                if isinstance(line, PreflightWarning):
                    _warn(report, line)
                else:
                    report.problems.append(line)
        except ConfigError as exc:
            report.problems.append(str(exc))
        except Exception as exc:  # a bug in a check must not stop a job the runtime could run
            line = (
                f"preflight check {check.name!r} could not run ({type(exc).__name__}: {first_line(exc)}), so what "
                "it checks was not checked; please report this as a bug"
            )
            report.failed.append(line)
            print(f"miles: warning: {line}", file=sys.stderr)
    report.seconds = time.perf_counter() - start
    return report


def _warn(report: Report, line: str) -> None:
    """A check's warning: said now on stderr, as the config's warnings were, and counted in the summary."""
    report.warned.append(str(line))
    report.warnings += 1
    print(f"miles: warning: {line}", file=sys.stderr)


def find_problems(resolved: ResolvedJob) -> list[str]:
    """Every problem the preflight finds in the job's inputs, one line each (empty: the job may start)."""
    return run_checks(resolved).problems


def problems_message(problems: list[str]) -> str:
    """One problem as it is; several as 'N problems:' and one indented line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {line}" for line in problems)


def preflight(resolved: ResolvedJob) -> Report:
    """ConfigError naming every problem the preflight finds; else the report (its checks and warnings)."""
    report = run_checks(resolved)
    if report.problems:
        raise ConfigError(problems_message(report.problems))
    return report


def passed_line(report: Report) -> str:
    """`miles: preflight passed (N checks[, W warnings above], S s)`."""
    warned = f", {report.warnings} warning{'s' if report.warnings != 1 else ''} above" if report.warnings else ""
    return f"miles: preflight passed ({report.checks} checks{warned}, {report.seconds:.2f} s)"


__all__ = [
    "CHECKS",
    "Check",
    "PreflightWarning",
    "Report",
    "find_problems",
    "passed_line",
    "preflight",
    "problems_message",
    "run_checks",
]
