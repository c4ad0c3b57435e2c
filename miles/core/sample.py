"""The rollout data contract: a sample is a whole denoising trajectory.

Everything here converts to and from plain dicts of tensors, numbers, strings, lists and dicts
(`to_dict` / `from_dict`), so a rollout file loads with `torch.load(weights_only=True)` and is all
`miles replay` needs.

Shapes (one sample; T = number of denoising steps, latents are C x h x w):
    Trajectory.latents      [T+1, C, h, w]  x_0 (initial noise) ... x_T (final latent), fp32
    Trajectory.timesteps    [T]             the model's timestep input at each step (1000 * sigma for SD3)
    Trajectory.sigmas       [T+1]           scheduler sigmas, terminal 0 included
    Trajectory.sde_step_indices             the steps that ran stochastically (their transitions are trained)
    Trajectory.log_probs    [len(sde_step_indices)]  log-prob of each recorded SDE transition
                                            x_i -> x_{i+1}, averaged over latent elements
    Trajectory.debug_model_outputs [T, C, h, w]  the engine's guided velocity per step (debug mode only)
    Trajectory.sde_means    [len(sde_step_indices), C, h, w]  the engine's step mean of each recorded SDE
                                            transition (--diffusion-grpo-guard only)
    Conditions.*            the prompt's encoder outputs (positive; negative when CFG is on)
    Sample.image            [3, H, W] float in [0, 1], the decoded image the reward saw; a video sample's
                            is [3, F, H, W] (latents are then C x f x h x w)
    Sample.sources          [[3, H, W], ...] float in [0, 1]: the decoded condition images of its prompt row
                            (an edit's source, an I2V first frame), in the row's order; None for a text prompt.
                            The rewards that score an edit against its source read them (`needs` "source").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

PENDING, COMPLETED, ABORTED, FAILED = "pending", "completed", "aborted", "failed"


@dataclass
class Trajectory:
    latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sde_step_indices: list[int] = field(default_factory=list)
    log_probs: torch.Tensor | None = None
    sde_type: str = "sde"
    noise_level: float = 0.0
    # --diffusion-debug-mode: the engine's guided model output at every step [T, *latent], what the trainer's
    # forward is compared with (train/model_output_*_abs_diff)
    debug_model_outputs: torch.Tensor | None = None
    # --diffusion-grpo-guard: the behaviour policy's step mean of every recorded SDE step [S, *latent] (in the
    # order of sde_step_indices), what RatioNorm's bias term compares the trainer's mean with
    sde_means: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**data)


@dataclass
class Conditions:
    """Encoder outputs of one prompt, as the family's condition inputs name them."""

    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None
    guidance_scale: float = 1.0
    guidance_scale_2: float | None = None  # a second expert's CFG scale (Wan2.2's low-noise expert)

    def to_dict(self) -> dict[str, Any]:
        return {
            "positive": self.positive,
            "negative": self.negative,
            "guidance_scale": self.guidance_scale,
            "guidance_scale_2": self.guidance_scale_2,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conditions:
        return cls(**data)


@dataclass
class Sample:
    """One generated output with everything its training needs."""

    index: int  # position in the rollout batch
    group_index: int  # monotonic over the run: which prompt group (of n_samples_per_prompt) it belongs to
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    trajectory: Trajectory | None = None
    conditions: Conditions | None = None
    image: torch.Tensor | None = None
    # the prompt row's condition images (editing, image-to-video): their files (absolute paths, the row's order),
    # and as the engine decoded them, each [3, H, W] in [0, 1] (None: a text-only prompt, or not generated yet);
    # plain tensors and strings, so a rollout file carries them; a file written before they existed loads without
    media: tuple[str, ...] = ()
    sources: list[torch.Tensor] | None = None
    reward: float | dict[str, float] | None = None
    # a multi-reward job's raw score of each reward type (`--rm-type a,b`, `--reward-weights`); `reward` is then
    # their weighted sum
    reward_components: dict[str, float] | None = None
    advantage: float | None = None
    remove_sample: bool = False
    status: str = PENDING
    inference_time_s: float = 0.0
    # the denoiser evaluations that made it: one per row and step (a CFG pair counts once), a shared prefix's
    # divided among the samples that branch from it (`rollout/denoiser_calls` sums them)
    denoiser_calls: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Trajectory, Conditions)):
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        if data.get("trajectory") is not None:
            data["trajectory"] = Trajectory.from_dict(data["trajectory"])
        if data.get("conditions") is not None:
            data["conditions"] = Conditions.from_dict(data["conditions"])
        return cls(**data)

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as one number: a dict reward is read at `reward_key`."""
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise ValueError(f"sample {self.index}: the reward is a dict {sorted(self.reward)}; set --reward-key")
            return float(self.reward[reward_key])
        return float(self.reward)
