"""What every rollout engine takes: one microgroup request per prompt (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    """One microgroup: a prompt encoded once, M samples with the seeds `seeds`.

    sde_steps[b] lists the denoising steps sample b runs stochastically (and records log-probs for);
    every other step is a deterministic ODE step. `indices` are the samples' positions in the batch.
    """

    prompt: str
    metadata: dict[str, Any]
    group_index: int
    indices: list[int]
    seeds: list[int]
    sde_steps: list[list[int]]
    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_type: str
    height: int
    width: int
    negative_prompt: str | None = None
    evaluation: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = len(self.seeds)
        if len(self.indices) != m or len(self.sde_steps) != m:
            raise ValueError(
                f"request for {m} seeds has {len(self.indices)} indices and {len(self.sde_steps)} step sets"
            )
