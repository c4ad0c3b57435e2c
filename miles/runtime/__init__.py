"""The Ray runtime: placement, trainer groups and the driver of each job.

`dispatch` is the only entry the CLI calls; it imports the job's driver lazily, so resolving and
printing args never imports torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from miles.config.errors import RuntimeUnavailable

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

# job -> module with a `run(resolved) -> int | None` function.
DRIVERS: dict[str, str] = {
    "rl": "miles.runtime.train_rl",
    "sft": "miles.runtime.train_sft",
    "dmd2": "miles.runtime.train_dmd2",
    "eval": "miles.runtime.eval_job",
    "rollout-only": "miles.runtime.rollout_only",
    "replay": "miles.runtime.replay",
}


def dispatch(resolved: ResolvedJob) -> int | None:
    module_name = DRIVERS[resolved.spec.name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise RuntimeUnavailable(
            f"the `miles {resolved.spec.command}` runtime is not available yet; the args above resolved cleanly"
        ) from None
    return module.run(resolved)
