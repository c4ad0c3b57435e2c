"""What every preflight check is: a small function of the resolved job that returns its problems."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

CheckFn = Callable[["ResolvedJob"], Iterable[str]]

TRAINING_JOBS = frozenset({"rl", "sft", "dmd2"})


@dataclass(frozen=True)
class Check:
    """One check: `run(resolved)` yields one line per problem (flag, value, what is wrong, what to do).

    `jobs`: the jobs it applies to (None: every job). A `ConfigError` it raises counts as one problem."""

    name: str
    run: CheckFn
    jobs: frozenset[str] | None = None

    def applies(self, job: str) -> bool:
        return self.jobs is None or job in self.jobs
