"""A job that joins a Ray cluster (`$RAY_ADDRESS` set): what its actors on other hosts need, said as warnings.

Nothing here refuses a job: the driver cannot see the other hosts' disks or networks. Quiet when `$RAY_ADDRESS` is
unset (the job starts its own Ray on this machine).

- the path flags the job's actors read or write (absolute on this host, `miles.config.paths`) must be on a
  filesystem every host shares: one line naming the flags in use;
- this host's name resolving to a loopback address, which torch's gloo would take as this node's address from the
  hostname: one line, since miles gives gloo each node's own interface (unless `--train-env-vars` names one).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles.preflight.base import PreflightWarning

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec
    from miles.config.resolve import ResolvedJob

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def check_several_hosts(resolved: ResolvedJob) -> list[str]:
    """The warnings of a job joining the Ray cluster at `$RAY_ADDRESS` (none without it)."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return []
    warnings: list[str] = []
    flags = list(dict.fromkeys(shared_path_flags(resolved)))
    if flags:
        warnings.append(
            PreflightWarning(
                f"the job joins the Ray cluster at RAY_ADDRESS={address}, whose actors run on its other hosts too: "
                f"{', '.join(flags)} must be on a filesystem every host shares (the same absolute path on each)"
            )
        )
    loopback = loopback_address()
    if loopback is not None and GLOO_IFNAME not in (resolved.args.train_env_vars or {}):
        warnings.append(
            PreflightWarning(
                f"this host's name resolves to {loopback} (loopback); miles gives gloo each node's own interface "
                f"({GLOO_IFNAME}); set it in --train-env-vars if your nodes need another"
            )
        )
    return warnings


def shared_path_flags(resolved: ResolvedJob) -> Iterator[str]:
    """The path flags (in use by this job, given as local paths) that its actors read or write."""
    from miles.preflight.checkpoint import output_folders
    from miles.preflight.data import eval_data_used
    from miles.preflight.models import MODEL_INPUTS

    args, job = resolved.args, resolved.spec
    for flag, value, _ in output_folders(args, job):
        if os.path.isabs(value):
            yield flag + (" (with the sglang engines' weight-sync folder)" if _sglang_sync(args, flag, job) else "")
    if job.saves_checkpoints and _local(args.load):
        yield "--load"
    if job.trains_on_rollouts and _local(args.load_debug_rollout_data):
        yield "--load-debug-rollout-data"
    if job.needs_prompt_data and _local(args.prompt_data):
        yield "--prompt-data"
    if eval_data_used(resolved):
        if _local(args.eval_config):
            yield "--eval-config"
        elif any(_local(path) for path in (args.eval_prompt_data or {}).values()):
            yield "--eval-prompt-data"
    for spec in MODEL_INPUTS:
        if spec.applies(job) and spec.used(args) and _local(getattr(args, spec.dest, None)):
            yield spec.flag
    if _sglang(args, job) and _local(args.sglang_python):
        yield "--sglang-python"


def _local(value: Any) -> bool:
    """A path on this host's disk: the resolution made every one absolute (a built-in name, a Hugging Face id or
    a URL is fetched or built on each host, and stays as given)."""
    return isinstance(value, str) and os.path.isabs(value)


def _sglang(args: Any, job: JobSpec) -> bool:
    return args.rollout_backend == "sglang" and job.generates and not args.train_only


def _sglang_sync(args: Any, flag: str, job: JobSpec) -> bool:
    """sglang engines load each weight sync from `<output-dir>/engines`, written by the trainer's rank 0."""
    return flag == "--output-dir" and job.alternates_rollout_and_training and _sglang(args, job)


def loopback_address() -> str | None:
    """This host's name's address when it is a loopback one (127.*), else None (also when it does not resolve)."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return address if address.startswith("127.") else None
