"""Starting or joining Ray for a job."""

from __future__ import annotations

import os
from typing import Any


def init_ray(args: Any) -> None:
    """Join the cluster at RAY_ADDRESS when set; otherwise start a new local one sized to this machine (never
    attach silently to a cluster someone started with `ray start`)."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    env_vars = {str(k): str(v) for k, v in (getattr(args, "train_env_vars", None) or {}).items()}
    env_vars.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    for name in ("MILES_HOME", "MILES_HTTP_POST_ACTORS_PER_NODE"):  # read by actors (--use-distributed-post)
        if name in os.environ:
            env_vars.setdefault(name, os.environ[name])
    runtime_env = {"env_vars": env_vars}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(address="local", include_dashboard=False, runtime_env=runtime_env, log_to_driver=True)
