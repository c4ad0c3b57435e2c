"""The plan as text: one row per GPU (node, gpu, what it holds with shares, the GPU's total share)."""

from __future__ import annotations

from miles.placement.plan import Plan


def plan_header(plan: Plan, cpu_run: bool = False) -> str:
    counts: dict[str, int] = {}
    for slot in plan.slots:
        counts[slot.role] = counts.get(slot.role, 0) + 1
    what = ", ".join(f"{role} x{n}" for role, n in counts.items()) or "nothing to place"
    where = plan.cluster.describe(plan.nodes if plan.cluster.elastic else None)
    used_nodes = len({node for node, _ in plan.by_gpu()})
    text = f"placement on {where}: {plan.num_gpus} GPU(s) on {used_nodes} node(s) used; {what}"
    if cpu_run:
        text += " (no GPU in the Ray cluster: each GPU of the plan is a CPU slot)"
    return text


def plan_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """(node, gpu, holds, total) per GPU, in node and GPU order."""
    rows = []
    for (node, gpu), slots in plan.by_gpu().items():
        holds = ", ".join(f"{s.label} ({s.share:.2f})" for s in slots)
        rows.append((str(node), str(gpu), holds, f"{sum(s.share for s in slots):.2f}"))
    return rows


def plan_lines(plan: Plan, cpu_run: bool = False) -> list[str]:
    """The plan table as plain, aligned text lines (for logs and the runtime)."""
    header = ("node", "gpu", "holds (share)", "total")
    rows = [header, *plan_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [plan_header(plan, cpu_run)]
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    return lines
