"""The memory check: each GPU's estimated peak (`miles.memory.estimate`) against its memory, before Ray starts.

It runs when the job will run on GPUs (this machine has some, or `$RAY_ADDRESS` names a cluster) or when
`--gpu-memory-gib` is given; a CPU run has no GPU memory to exceed. A job with no estimate (a checkpoint miles
has neither a local directory nor shipped configs for) is not refused for it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


def check_gpu_memory(resolved: ResolvedJob) -> list[str]:
    from miles.preflight.cluster import local_machine

    args = resolved.args
    on_gpus = bool(os.environ.get("RAY_ADDRESS")) or local_machine().gpus > 0
    if args.gpu_memory_gib is None and not on_gpus:
        return []
    from miles.memory.estimate import estimate_memory, refusal

    try:
        estimate = estimate_memory(resolved)
    except LookupError:
        return []
    if estimate.fits():
        return []
    recipe = f"--recipe {resolved.recipe.removeprefix('recipe ')} " if resolved.recipe else ""
    hint = f"`miles plan {recipe}...` with the same flags computes the changes that fit"
    return [f"{refusal(estimate, None)}; {hint}"]
