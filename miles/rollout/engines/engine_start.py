"""Where the diffusers engine actors run and how they start.

The driver starts them itself, right after the placement is reserved and beside the rollout manager and the
trainers, so that their model loads overlap (an engine started by the manager waited for the manager's own
process to come up first: about 3 s of every start-up on 2 cores). The manager's `EngineSupervisor` takes the
handles over; a restart starts a new actor with the same options from the manager.
"""

from __future__ import annotations

from typing import Any


def engine_options(args: Any, placement: Any, i: int) -> dict[str, Any]:
    """Ray options of engine i: its slot of the plan, or no GPU without a placement. A CPU engine on the caller's
    node starts with that node's cores as its torch threads (`miles.utils.torch_threads`) unless --train-env-vars
    sets OMP_NUM_THREADS for every actor."""
    if placement is None:
        return {"num_gpus": 0, "num_cpus": 0}
    slot = placement.slots("engine")[i]
    options = placement.options(slot)
    user_threads = "OMP_NUM_THREADS" in (args.train_env_vars or {})
    if not placement.gpu_mode and not user_threads:
        import os

        from miles.utils.torch_threads import thread_options_here

        options.update(thread_options_here(placement.node_id(slot), os.cpu_count()))
    return options


def engine_slot(placement: Any, i: int) -> str:
    """Where engine i runs, for messages: "node 0, GPU 3" ("node 0, CPU" on a CPU cluster); "" without a plan."""
    if placement is None:
        return ""
    slot = placement.slots("engine")[i]
    gpus = placement.gpu_ids(slot)
    return f"node {slot.node}, " + (f"GPU {','.join(str(g) for g in gpus)}" if gpus else "CPU")


def starts_engine_actors(args: Any) -> bool:
    """The jobs whose engines are diffusers actors (sglang's servers start from their own supervisor)."""
    return args.rollout_backend != "sglang"


def prefetch_engine_class() -> None:
    """Import the engine's module (torch with it, about 1.6 s on 2 cores) on a thread of its own, so that it is
    loaded by the time the engines start: the driver calls this before it starts Ray, which mostly waits."""
    import importlib
    import threading

    threading.Thread(
        target=importlib.import_module, args=("miles.rollout.engines.diffusers_engine",), daemon=True
    ).start()


def start_engine_actors(args: Any, placement: Any) -> list[Any]:
    """One engine actor per engine slot of the plan, created now and not waited for (the supervisor waits)."""
    from miles.rollout.engines.diffusers_engine import engine_actor_class
    from miles.utils.actors import tag_for

    actor = engine_actor_class()
    return [
        actor.options(**engine_options(args, placement, i)).remote(args, _miles_tag=tag_for(args, "engine", i))
        for i in range(len(placement.slots("engine")))
    ]
