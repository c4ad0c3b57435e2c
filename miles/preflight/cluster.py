"""The cluster: the placement plan against what this machine really has, when the job starts its own Ray.

With `$RAY_ADDRESS` set the job joins that cluster and the runtime plans against Ray's view, so nothing is
checked here. Otherwise the local Ray gets this machine's GPUs, counted without torch or CUDA
(`/dev/nvidia<N>`, else `nvidia-smi -L`, narrowed by `CUDA_VISIBLE_DEVICES`): with GPUs the plan must fit on
them (`miles.placement.plan.make_plan`, the runtime's own placement); with none every GPU of the plan
becomes a CPU slot (`gpu_mode` off in `miles.placement.ray_placement`), which is refused when the plan has
more slots than the machine has CPUs.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.core.errors import ConfigError

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

NVIDIA_SMI_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Machine:
    """What a local Ray would see on this machine."""

    gpus: int
    cpus: int
    how: str  # how the GPUs were counted, for messages


def _visible(count: int) -> tuple[int, str]:
    """`count` GPUs narrowed by CUDA_VISIBLE_DEVICES (as CUDA and Ray read it)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return count, ""
    ids = [part.strip() for part in value.split(",") if part.strip()]
    if not ids or ids[0] == "-1":
        return 0, f" (CUDA_VISIBLE_DEVICES={value!r} hides them)"
    return min(count, len(ids)), f" (CUDA_VISIBLE_DEVICES={value})"


def count_gpus() -> tuple[int, str]:
    """(NVIDIA GPUs on this machine, how they were counted); torch- and CUDA-free."""
    devices = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    if devices:
        count, note = _visible(len(devices))
        return count, f"{len(devices)} /dev/nvidia* devices{note}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        found = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        if found:
            count, note = _visible(found)
            return count, f"nvidia-smi lists {found}{note}"
    return 0, "no /dev/nvidia* device, no nvidia-smi GPU"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_machine() -> Machine:
    gpus, how = count_gpus()
    return Machine(gpus=gpus, cpus=cpu_count(), how=how)


def cpu_recipes(job: str) -> list[str]:
    """The shipped recipes made for CPUs (their description starts with 'CPU'), those of `job` first and the
    embedded default's (tiny-digits-*) first among them."""
    from miles.config.recipes import shipped_recipes

    found = []
    for name, path in shipped_recipes().items():
        try:
            with open(path, encoding="utf-8") as handle:
                head = handle.read(400)
        except OSError:
            continue
        if re.search(r"^description:\s*['\"]?CPU\b", head, re.MULTILINE):
            same_job = re.search(rf"^job:\s*['\"]?{re.escape(job)}['\"]?\s*$", head, re.MULTILINE) is not None
            found.append((not same_job, not name.startswith("tiny-digits"), name))
    return [name for *_, name in sorted(found)]


SLOTS_PER_CPU = 2  # GPU slots of a plan run as CPU processes, at most this many per core


def check_cluster(resolved: ResolvedJob) -> list[str]:
    """The plan fits this machine (nothing to check when the job joins the Ray cluster at $RAY_ADDRESS)."""
    if os.environ.get("RAY_ADDRESS") or _ray_already_up():
        return []
    from miles.placement.cluster import ClusterSpec, NodeSpec, flags_cluster
    from miles.placement.plan import make_plan

    machine = local_machine()
    args, job = resolved.args, resolved.spec
    if machine.gpus > 0:
        here = ClusterSpec((NodeSpec(gpus=machine.gpus, cpus=float(machine.cpus)),), source="this machine")
        try:
            make_plan(args, here, job)
        except ConfigError as exc:
            return [f"{exc} ({machine.how}; $RAY_ADDRESS unset, so the job starts its own Ray here)"]
        return []
    try:
        plan = make_plan(args, flags_cluster(args), job)
    except ConfigError as exc:
        return [str(exc)]
    slots = plan.num_gpus
    if slots <= SLOTS_PER_CPU * machine.cpus:  # each slot a process of its own: more than two a core crawls
        return []
    tiny = cpu_recipes(job.name)
    recipes = f"a CPU recipe such as {tiny[0]}" if tiny else "a CPU recipe"
    nodes = max(1, len(plan.nodes))
    plan_cmd = f"miles plan {_recipe_flag(resolved)}--cluster {nodes}x{int(args.num_gpus_per_node)}"
    return [
        f"cluster: the plan needs {slots} GPUs on {nodes} node(s) but this machine has no GPU ({machine.how}) and "
        f"{machine.cpus} CPUs, too few to run {slots} GPU slots on CPU (at most {SLOTS_PER_CPU} a CPU); "
        "run it on a GPU machine (or set "
        f"RAY_ADDRESS to a GPU cluster), plan only with `{plan_cmd}`, or start from {recipes} "
        "(`miles recipes` lists them)"
    ]


def _recipe_flag(resolved: ResolvedJob) -> str:
    label = resolved.recipe or ""
    name = label.removeprefix("recipe ") if label else ""
    return f"--recipe {name} " if name else ""


def _ray_already_up() -> bool:
    """This process already holds a Ray connection (a simulated-GPU cluster of a test or a notebook): the job
    runs on it (`init_ray` joins it), so the runtime plans against Ray's view. Never imports Ray."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
