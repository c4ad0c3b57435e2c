"""How one engine request samples beyond its SDE steps (torch-free): where a shared prefix branches
(`--diffusion-shared-prefix`), which deterministic steps come after a row's SDE window (`--diffusion-ode-solver`
applies there) and where the schedule is compressed (`--diffusion-post-sde-steps-ratio`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NEVER = 1 << 30  # a branch step no schedule reaches: the whole trajectory is shared


class Request(Protocol):
    """What a plan reads of an engine's request (the engines' `GenerateRequest`)."""

    evaluation: bool
    shared_prefix: bool
    post_sde_steps_ratio: float | None


@dataclass(frozen=True)
class SamplingPlan:
    """`branch_at`: the step at which a shared prefix (one initial noise, run at batch 1) becomes one row per sample
    (None: no shared prefix; 0: only the initial noise is shared; `NEVER`: nothing stochastic, every row is the
    prefix). `last_sde`: each row's last SDE step (-1:
    none). `compress_after`: the last SDE step the schedule is compressed after, or None."""

    branch_at: int | None
    last_sde: tuple[int, ...]
    compress_after: int | None

    @classmethod
    def of(cls, req: Request, sde_sets: list[set[int]]) -> SamplingPlan:
        last = tuple(max(steps) if steps else -1 for steps in sde_sets)
        shared = all(steps == sde_sets[0] for steps in sde_sets)
        branch_at = None
        if req.shared_prefix and not req.evaluation:
            if not shared:
                raise ValueError(
                    "--diffusion-shared-prefix: the samples of one request must share their SDE steps (the step "
                    f"strategy gave {sorted(map(sorted, sde_sets))}); the manager draws them once per microgroup"
                )
            branch_at = min(sde_sets[0]) if sde_sets[0] else NEVER
        compress = None
        if req.post_sde_steps_ratio is not None and not req.evaluation and sde_sets and sde_sets[0]:
            if not shared:
                raise ValueError(
                    "--diffusion-post-sde-steps-ratio: the samples of one request share one schedule, so they must "
                    f"share their SDE steps (got {sorted(map(sorted, sde_sets))})"
                )
            compress = last[0]
        return cls(branch_at, last, compress)

    def after_window(self, row: int, step: int) -> bool:
        """Whether `step` comes after row `row`'s last SDE step (a row without SDE steps has no window)."""
        return 0 <= self.last_sde[row] < step
