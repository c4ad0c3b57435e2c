"""Starting or joining Ray for a job."""

from __future__ import annotations

import logging
import os
from typing import Any


def init_ray(args: Any) -> None:
    """Join the cluster at RAY_ADDRESS when set; otherwise start a new local one sized to this machine (never
    attach silently to a cluster someone started with `ray start`), with a reaper that ends it if this driver
    is killed (`miles.runtime.reaper`). Without --verbose, Ray's own output goes to logs/driver.log
    (`miles.runtime.terminal`)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    env_vars = {str(k): str(v) for k, v in (args.train_env_vars or {}).items()}
    env_vars.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    for name in ("MILES_HOME", "MILES_HTTP_POST_ACTORS_PER_NODE"):  # read by actors (--use-distributed-post)
        if name in os.environ:
            env_vars.setdefault(name, os.environ[name])
    runtime_env = {"env_vars": env_vars}
    verbose = bool(args.verbose)
    quiet: dict[str, Any] = {}
    if not verbose and args.output_dir:
        from miles.runtime.terminal import quiet_ray
        from miles.utils.actors import logs_dir

        quiet_ray(logs_dir(args))
        quiet = {"configure_logging": False}
    from miles.runtime.signals import reinstall

    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, **quiet)
        reinstall()
        return
    ray.init(
        address="local",
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=True,
        **quiet,
    )
    reinstall()
    from miles.runtime.reaper import start_reaper

    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    if node is not None:
        session = node.get_session_dir_path()
        logging.getLogger("miles.runtime").info("ray session: %s", session)  # driver.log: what the reaper ends
        start_reaper(session)
