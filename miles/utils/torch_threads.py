"""An actor's torch threads, given to its process before torch starts.

Ray starts an actor that asks for less than one CPU with OMP_NUM_THREADS=1, so torch starts with one intra-op thread.
Raising it with `torch.set_num_threads` works but costs: measured on 2 cores, a Flow-GRPO optimizer step ran 5-15 %
slower, with 2-3x the system time, after `torch.set_num_threads(2)` than with torch's own default of 2 (the same
count; the call also pins MKL's threading). So an actor that knows its thread count before it starts gets it as
OMP_NUM_THREADS in its runtime environment (`thread_options`), and `use_threads` calls `torch.set_num_threads` only
when torch has another count (a remote node, or a value the hint could not know).
"""

from __future__ import annotations

from typing import Any


def thread_options(threads: int | None) -> dict[str, Any]:
    """Ray actor options that start the actor's process with `threads` OpenMP threads ({} for None)."""
    if threads is None:
        return {}
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(threads)))}}}


def thread_options_here(node_id: str, threads: int | None) -> dict[str, Any]:
    """`thread_options(threads)` for an actor placed on `node_id` when that is the caller's own node, the one node
    whose cores the caller knows; {} elsewhere (that actor sets its threads itself, `use_threads`)."""
    import ray

    return thread_options(threads) if node_id == ray.get_runtime_context().get_node_id() else {}


def use_threads(threads: int) -> None:
    """torch's intra-op threads at `threads`, set only if it has another count."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
