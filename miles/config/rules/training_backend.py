"""Training-backend rules: process-group and attention backend names, and what sequence parallelism cannot do.

Which device a trainer rank really has is only known inside the rank, so the rank itself refuses a
backend that needs a device it lacks (`miles.training.parallel`); here only the names are checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.backends import ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS, cpu_capable
from miles.config.flags import closest
from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def _unknown(res: Resolution, dest: str, known: list[str], what: str) -> str:
    suggestion = closest(str(res[dest]), known)
    hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
    return f"{res.show(dest)} is not a {what}{hint}; known: {', '.join(known)}"


def check_distributed_backends(res: Resolution, job: JobSpec) -> None:
    known = list(DISTRIBUTED_BACKENDS)
    for dest in ("distributed_backend", "fsdp_cpu_backend"):
        if res[dest] not in DISTRIBUTED_BACKENDS:
            res.fail(_unknown(res, dest, known, "torch.distributed backend"))
    if not cpu_capable(res["fsdp_cpu_backend"]):
        usable = ", ".join(name for name in known if cpu_capable(name))
        res.fail(f"{res.show('fsdp_cpu_backend')} cannot hold CPU tensors; use one of {usable}")


def check_attention_backend(res: Resolution, job: JobSpec) -> None:
    name = res["fsdp_attention_backend"]
    if name is not None and name not in ATTENTION_BACKENDS:
        res.fail(_unknown(res, "fsdp_attention_backend", list(ATTENTION_BACKENDS), "diffusers attention backend"))


def check_sequence_parallel_losses(res: Resolution, job: JobSpec) -> None:
    if res["sequence_parallel_size"] > 1 and res["dmd2_gan_loss_weight"] > 0 and job.trains:
        res.fail(
            f"{res.show('sequence_parallel_size')} cannot train {res.show('dmd2_gan_loss_weight')}: the GAN head "
            "pools one block's image tokens, which sequence parallelism splits across ranks"
        )


RULES = (check_distributed_backends, check_attention_backend, check_sequence_parallel_losses)
