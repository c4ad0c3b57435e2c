"""The memory plan as `miles plan` and `inspect-config` show it, and the check that refuses a plan over capacity.

`memory_for(resolved, plan, reresolve)` returns (estimate or None, lines to print); the lines say why when there is
no estimate (a checkpoint with no local directory and no shipped configs, a CPU-only family). `enforce(...)`
raises the one-line `ConfigError` of a plan over capacity, with the computed changes that fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from miles.core.errors import ConfigError
from miles.memory.estimate import (
    MARGIN_GIB,
    MemoryEstimate,
    candidate_changes,
    estimate_memory,
    fit_changes,
    refusal,
)
from miles.memory.static import GIB, ROLLOUT, SYNC, TRAIN


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f}"


def memory_for(resolved: Any, plan: Any) -> tuple[MemoryEstimate | None, list[str]]:
    try:
        estimate = estimate_memory(resolved, plan)
    except LookupError as exc:
        return None, [f"memory: not estimated: {exc}"]
    return estimate, summary_lines(estimate)


PHASE_COLUMNS = (TRAIN, SYNC, ROLLOUT)


def gpu_columns(estimate: MemoryEstimate | None, node: int, gpu: int) -> tuple[str, ...]:
    """(train, sync, rollout) GiB of one GPU, with the margin; "-" for a phase the GPU is idle in."""
    if estimate is None:
        return ("",) * len(PHASE_COLUMNS)
    for g in estimate.gpus:
        if (g.node, g.gpu) == (node, gpu):
            return tuple(f"{estimate.with_margin(g.total(p)):.1f}" if g.total(p) else "-" for p in PHASE_COLUMNS)
    return ("",) * len(PHASE_COLUMNS)


def summary_lines(estimate: MemoryEstimate) -> list[str]:
    gpu, phase, nbytes = estimate.peak()
    cap = "no check (--gpu-memory-gib 0)" if estimate.capacity_gib <= 0 else f"{estimate.capacity_gib:g} GiB"
    verdict = "fits" if estimate.fits() else "DOES NOT FIT"
    model = estimate.static.model
    trainable = ", ".join(f"{role} {n / 1e6:,.1f} M" for role, n in model.trainable.items())
    lines = [
        f"memory: peak {estimate.with_margin(nbytes):.1f} GiB per GPU (node {gpu.node} GPU {gpu.gpu}, {phase}; "
        f"incl. a {MARGIN_GIB} GiB CUDA margin) of {cap} ({estimate.capacity_source}): {verdict}",
        f"memory: {model.checkpoint}: {model.total / 1e9:.2f} B parameters; trainable {trainable}",
    ]
    for phase_name in (TRAIN, ROLLOUT):
        top = gpu.largest(phase_name)
        if top:
            parts = ", ".join(f"{e.name} {gib(e.bytes)}" for e in top)
            lines.append(f"memory: largest on that GPU in {phase_name} (GiB): {parts}")
    for t in estimate.traces:
        lines.append(f"memory: traced {t['what']} ({t['spec']}): {t['gib']:.2f} GiB of activations")
    lines += [f"memory: note: {n}" for n in estimate.notes]
    return lines


def enforce(
    estimate: MemoryEstimate,
    resolved: Any,
    reresolve: Callable[[Mapping[str, Any]], Any] | None,
    make_plan_for: Callable[[Any], Any],
) -> None:
    """Refuse a plan over capacity: one line with the peak, the capacity and the computed changes."""
    if estimate.fits():
        return
    changes = []
    if reresolve is not None:
        changes = fit_changes(estimate, reresolve, candidate_changes(resolved), make_plan_for)
    raise ConfigError(refusal(estimate, changes))


def json_rows(plan: Any, estimate: MemoryEstimate | None) -> list[dict[str, Any]]:
    """The plan's rows, each with its GPU's memory per phase (entries in bytes and GiB) when estimated."""
    rows = plan.rows()
    if estimate is None:
        return rows
    for row in rows:
        row["memory"] = estimate.gpu_json(int(row["node"]), int(row["gpu"]))
    return rows
