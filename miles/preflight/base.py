"""What every preflight check is: a small function of the resolved job that returns its problems."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.config.resolve import ResolvedJob

CheckFn = Callable[["ResolvedJob"], Iterable[str]]


class PreflightWarning(str):
    """A line a check yields that warns and refuses nothing: printed as `miles: warning: ...` when the check runs
    and counted among the summary's warnings (`passed_line`), never a problem."""


@dataclass(frozen=True)
class Check:
    """One check: `run(resolved)` yields one line per problem (flag, value, what is wrong, what to do), or a
    `PreflightWarning` for what it can only warn about.

    `applies_to`: which jobs it applies to, read from the job's row of the job table (`miles.config.jobs`), e.g.
    `attrgetter("saves_checkpoints")`; None: every job. A `ConfigError` it raises counts as one problem."""

    name: str
    run: CheckFn
    applies_to: Callable[[JobSpec], bool] | None = None

    def applies(self, job: JobSpec) -> bool:
        return self.applies_to is None or bool(self.applies_to(job))
