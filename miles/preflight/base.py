"""What every preflight check is: a small function of the resolved job that returns its problems."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

CheckFn = Callable[["ResolvedJob"], Iterable[str]]

TRAINING_JOBS = frozenset({"rl", "sft", "dmd2"})


class PreflightWarning(str):
    """A line a check yields that warns and refuses nothing: printed as `miles: warning: ...` when the check runs
    and counted among the summary's warnings (`passed_line`), never a problem."""


@dataclass(frozen=True)
class Check:
    """One check: `run(resolved)` yields one line per problem (flag, value, what is wrong, what to do), or a
    `PreflightWarning` for what it can only warn about.

    `jobs`: the jobs it applies to (None: every job). A `ConfigError` it raises counts as one problem."""

    name: str
    run: CheckFn
    jobs: frozenset[str] | None = None

    def applies(self, job: str) -> bool:
        return self.jobs is None or job in self.jobs
