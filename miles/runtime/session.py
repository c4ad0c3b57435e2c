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
from miles.runtime.failures import host_lost_line
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
    manager_node: tuple[str, str] | None = None  # (Ray node id, address) the manager is pinned to
    metrics_start: int = 0  # bytes of <output-dir>/metrics.jsonl written before this job (a reused dir)

    def record_placement(self, groups: Sequence[Any] = ()) -> Path:
        """Check every actor against the plan and write `<output-dir>/placement.json` (once all are up)."""
        from miles.runtime.placement_record import record_placement

        return record_placement(self.out, self.placement, list(groups), self.manager, self.manager_node)


def default_manager_class() -> Any:
    from miles.rollout.manager import manager_actor_class

    return manager_actor_class()


def start_host_watch(args: Any, placement: RayPlacement, manager_node: tuple[str, str] | None) -> Any:
    """Watch the hosts the job uses other than the driver's own (`miles.runtime.host_watch`); None when the
    whole job runs on the driver's node."""
    import ray

    import miles.runtime.host_watch as host_watch

    host_watch.reset()
    hosts = host_watch.hosts_of(placement, manager_node, bool(getattr(args, "use_fault_tolerance", False)))
    hosts.pop(ray.get_runtime_context().get_node_id(), None)
    if not hosts:
        return None
    return host_watch.HostWatch(hosts, float(args.host_timeout), lambda lost: host_lost_line(lost, args)).start()


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
    from miles.rollout.engines.engine_start import prefetch_engine_class, start_engine_actors, starts_engine_actors

    out = prepare_output_dir(resolved)
    prepare_inputs(args)
    if manager_class is not None and starts_engine_actors(args):
        prefetch_engine_class()  # torch, imported while Ray starts: the engines' class needs it
    init_ray(args)
    manager = None
    manager_node = None
    watch = None
    clean = False
    try:
        placement = place(args, resolved.spec)
        print("miles: " + "\n".join(plan_lines(placement.plan, cpu_run=not placement.gpu_mode)), flush=True)
        if manager_class is not None:
            from miles.placement import manager_node as where

            manager_node = where.find_node(where.setting(args))
            print(f"miles: rollout manager on node {manager_node[1]} (--rollout-manager-node {where.setting(args)})")
            # the engines start now, beside the manager, not after its process is up (`engine_start`)
            engines = start_engine_actors(args, placement) if starts_engine_actors(args) else None
            manager = (
                manager_class()
                .options(**where.actor_options(manager_node[0]))
                .remote(args, None, True, placement, engines, _miles_tag=tag_for(args, "rollout_manager"))
            )
        watch = start_host_watch(args, placement, manager_node)
        from miles.utils.gc_pauses import freeze_startup_objects

        freeze_startup_objects()  # the driver's imports and set-up: out of the garbage collector's walks
        yield JobSession(out, placement, manager, manager_node=manager_node, metrics_start=metrics_mark(out))
        clean = True
    finally:
        if watch is not None:
            watch.stop(failing=not clean)
        # after a failure or an interrupt the manager gets a few seconds to stop its engines and servers, then
        # Ray ends every actor (the job's cluster, or the driver's actors on a shared one)
        if manager is not None:
            with contextlib.suppress(Exception):
                ray.get(manager.shutdown.remote(), timeout=60 if clean else 5)
        ray.shutdown()
