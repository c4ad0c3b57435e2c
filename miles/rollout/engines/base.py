"""What every rollout engine takes: one microgroup request per prompt (torch-free)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.core.sample import Sample


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
    true_cfg_scale: float | None = None  # --diffusion-true-cfg-scale (families with embedded guidance or true CFG)
    num_frames: int = 1  # --diffusion-output-num-frames (1: an image)
    fps: float | None = None  # --diffusion-fps (video only: the frame rate of the video files)
    guidance_scale_2: float | None = None  # --diffusion-guidance-scale-2 (Wan2.2's low-noise expert)
    debug: bool = False  # --diffusion-debug-mode: return the model output of every step
    record_means: bool = False  # --diffusion-grpo-guard: return the step mean of every SDE step
    shared_prefix: bool = False  # --diffusion-shared-prefix: one initial noise, the steps before the SDE window once
    ode_solver: str = "euler"  # --diffusion-ode-solver: the deterministic steps after the SDE window
    post_sde_steps_ratio: float | None = None  # --diffusion-post-sde-steps-ratio: compress the steps after the window
    media: tuple[str, ...] = ()  # the prompt row's condition images (absolute paths, in the row's order)

    def __post_init__(self) -> None:
        m = len(self.seeds)
        if len(self.indices) != m or len(self.sde_steps) != m:
            raise ValueError(
                f"request for {m} seeds has {len(self.indices)} indices and {len(self.sde_steps)} step sets"
            )

    def sample(self, b: int, **fields: Any) -> Sample:
        """The completed sample of this request's b-th seed; `fields` are what the engine produced."""
        from miles.core.sample import COMPLETED, Sample  # torch: only once an engine has run

        return Sample(
            index=self.indices[b],
            group_index=self.group_index,
            prompt=self.prompt,
            metadata=copy.deepcopy(self.metadata),
            seed=self.seeds[b],
            status=COMPLETED,
            media=self.media,
            **fields,
        )
