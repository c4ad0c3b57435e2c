"""User hooks for tests/training/test_custom_hooks.py, loaded by dotted path (`train_hooks_helpers.NAME`)."""

from __future__ import annotations

from typing import Any

import torch

from miles.algorithms.policy_loss import policy_loss
from miles.algorithms.sft_loss import sft_loss
from miles.core.sample import Sample
from miles.sampling.sde import sde_step
from miles.training.pairs import Pair, expand_flow_grpo

SEEN_KEYS: list[set[str]] = []  # the batch keys flow_matching_loss saw, newest last


def flow_grpo_loss(args: Any, batch: dict[str, Any], model_output: torch.Tensor):
    """policy_loss as a custom loss, on the default (Flow-GRPO) batch; the reference velocity gives the KL."""

    def step(velocity: torch.Tensor):
        return sde_step(
            velocity,
            batch["latents"],
            batch["sigmas"],
            batch["next_sigmas"],
            sde_type=batch["sde_type"],
            noise_level=batch["noise_level"],
            sigma_max=batch["sigma_max"],
            prev_sample=batch["next_latents"],
        )

    res = step(model_output)
    ref = batch.get("ref_model_output")
    return policy_loss(
        res.log_prob,
        batch["old_log_probs"],
        batch["advantages"],
        clip_range=args.diffusion_clip_range,
        adv_clip_max=args.diffusion_adv_clip_max,
        kl_beta=args.diffusion_kl_beta,
        mean_new=res.mean,
        mean_ref=None if ref is None else step(ref).mean,
        std_dev_t=res.std_dev_t,
    )


def first_sde_step_only(args: Any, samples: list[Sample]) -> list[Pair]:
    """Expansion: only the first recorded SDE transition of each kept sample."""
    return [
        Pair(s, s.trajectory.sde_step_indices[0], 0)
        for s in samples
        if not s.remove_sample and s.trajectory is not None and s.trajectory.sde_step_indices
    ]


def one_step_per_group(args: Any, samples: list[Sample]) -> list[list[Pair]]:
    """Conversion: one optimizer step per prompt group, each on all its recorded transitions."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return [expand_flow_grpo(group) for _, group in sorted(groups.items())]


def final_latent_inputs(args: Any, pairs: list[Pair]) -> dict[str, Any]:
    """Prepare: flow matching on each pair's final latent at sigma 0.5 (conditions left to the trainer)."""
    x0 = torch.stack([p.sample.trajectory.latents[-1] for p in pairs]).float()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((len(pairs),), 0.5)
    latents = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    return {"latents": latents, "timesteps": sigma * 1000.0, "target": noise - x0, "guidance_scale": None}


def flow_matching_loss(args: Any, batch: dict[str, Any], model_output: torch.Tensor):
    SEEN_KEYS.append(set(batch))
    loss = ((model_output - batch["target"]) ** 2).mean()
    return loss, {"fm_mse": loss.detach()}


def sft_as_custom_loss(args: Any, batch: dict[str, Any], model_output: torch.Tensor):
    """sft_loss on the default `train sft` batch (over the family's `data_mask` elements when it has one)."""
    return sft_loss(model_output, batch["clean_latents"], batch["noise"], batch["sigmas"], mask=batch["data_mask"])


# ---- hooks that return the wrong thing ------------------------------------------------------------
def pairs_as_strings(args: Any, samples: list[Sample]) -> list[str]:
    return [str(s.index) for s in samples]


def unrecorded_step(args: Any, samples: list[Sample]) -> list[Pair]:
    return [Pair(s, s.trajectory.sde_step_indices[0], 1) for s in samples]  # slot 1 is the second step


def steps_as_a_dict(args: Any, samples: list[Sample]) -> dict[str, Any]:
    return {"steps": samples}


def inputs_without_timesteps(args: Any, pairs: list[Pair]) -> dict[str, Any]:
    return {"latents": torch.stack([p.sample.trajectory.latents[p.step] for p in pairs])}


def bare_tensor_loss(args: Any, batch: dict[str, Any], model_output: torch.Tensor) -> torch.Tensor:
    return model_output.mean()


def detached_loss(args: Any, batch: dict[str, Any], model_output: torch.Tensor):
    return model_output.detach().mean(), {}
