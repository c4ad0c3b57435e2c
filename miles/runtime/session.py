"""What every Ray job does first: the output dir, the inputs it starts from, Ray, and the rollout manager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.runtime.output import prepare_inputs, prepare_output_dir
from miles.runtime.ray_setup import init_ray

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob


@contextlib.contextmanager
def ray_job(resolved: ResolvedJob, args: Any, with_manager: bool = True) -> Iterator[tuple[Path, Any]]:
    """Yields `(output_dir, rollout_manager_actor or None)`; Ray is shut down on the way out."""
    import ray

    out = prepare_output_dir(resolved)
    prepare_inputs(args)
    init_ray(args)
    manager = None
    try:
        if with_manager:
            from miles.rollout.manager import manager_actor_class

            manager = manager_actor_class().options(num_cpus=0).remote(args, None, True)
        yield out, manager
    finally:
        if manager is not None:
            with contextlib.suppress(Exception):
                ray.get(manager.shutdown.remote(), timeout=60)
        ray.shutdown()
