"""What every Ray job does first: the output dir, the inputs it starts from, Ray, the placement plan made
real, and the rollout manager."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.builtin.inputs import prepare_inputs
from miles.runtime.ci_check import metrics_mark
from miles.runtime.output import prepare_output_dir
from miles.runtime.ray_setup import init_ray
from miles.utils.actors import tag_for

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob
    from miles.placement.ray_placement import RayPlacement


@dataclass
class JobSession:
    out: Path
    placement: RayPlacement
    manager: Any = None  # the rollout manager actor, for jobs with engines
    metrics_start: int = 0  # bytes of <output-dir>/metrics.jsonl written before this job (a reused dir)

    def record_placement(self, groups: Sequence[Any] = ()) -> Path:
        """Check every actor against the plan and write `<output-dir>/placement.json` (once all are up)."""
        from miles.runtime.placement_record import record_placement

        return record_placement(self.out, self.placement, list(groups), self.manager)


def default_manager_class() -> Any:
    from miles.rollout.manager import manager_actor_class

    return manager_actor_class()


@contextlib.contextmanager
def ray_job(
    resolved: ResolvedJob, args: Any, manager_class: Callable[[], Any] | None = default_manager_class
) -> Iterator[JobSession]:
    """Start Ray, plan the job on the cluster Ray sees and reserve its bundles (a plan that does not fit is
    one ConfigError), print the plan, start the rollout manager (`manager_class`, None for train-only
    jobs); Ray is shut down on the way out."""
    import ray

    from miles.placement.ray_placement import place
    from miles.placement.render import plan_lines

    out = prepare_output_dir(resolved)
    prepare_inputs(args)
    init_ray(args)
    manager = None
    clean = False
    try:
        placement = place(args, resolved.spec)
        print("miles: " + "\n".join(plan_lines(placement.plan, cpu_run=not placement.gpu_mode)), flush=True)
        if manager_class is not None:
            manager = (
                manager_class()
                .options(num_cpus=0)
                .remote(args, None, True, placement, _miles_tag=tag_for(args, "rollout_manager"))
            )
        yield JobSession(out, placement, manager, metrics_mark(out))
        clean = True
    finally:
        # after a failure or an interrupt the manager gets a few seconds to stop its engines and servers, then
        # Ray ends every actor (the job's cluster, or the driver's actors on a shared one)
        if manager is not None:
            with contextlib.suppress(Exception):
                ray.get(manager.shutdown.remote(), timeout=60 if clean else 5)
        ray.shutdown()
