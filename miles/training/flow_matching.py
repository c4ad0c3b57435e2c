"""The dataset step: flow matching on clean latents (`Trainer.train_sft`, every method's default).

Per micro-batch: sigma from the shifted logit-normal (`--fsdp-flow-shift`; within the trained experts' range),
fresh noise, the noised latents; the method's `data_loss(batch, inputs)` takes them. The default loss
(`flow_matching_loss`, `--loss-type sft_loss`) is `miles.algorithms.sft_loss.sft_loss` on the unguided velocity,
over the elements the data carries and the model generates (the family's `loss_mask`: LTX-2's video; not
Wan2.2 TI2V's condition frame).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from miles.algorithms.sft_loss import noisy_latents, sample_sigmas, sft_loss
from miles.core.sample import Sample
from miles.training.model import target_components
from miles.training.pairs import Pair

if TYPE_CHECKING:
    from miles.training.trainer import Trainer

Loss = tuple[torch.Tensor, dict[str, float]]
DataLoss = Callable[[list[Pair], dict[str, Any]], Loss]


def flow_matching_step(
    trainer: Trainer, x0: torch.Tensor, conditions: list[Sample], loss_of: DataLoss
) -> dict[str, float]:
    """One optimizer step of `loss_of(batch, inputs)` over noised dataset latents; `inputs` holds latents (noised),
    timesteps, sigmas, clean_latents, noise, guidance_scale (None) and data_mask."""
    start = time.perf_counter()
    pairs = [Pair(s, 0, i) for i, s in enumerate(conditions)]
    sigma_range = trainer.family.trainable_sigma_range(target_components(trainer.args))
    data_mask = trainer.family.loss_mask(tuple(x0.shape[1:]))  # data_mask and generated_mask

    def micro(batch: list[Pair]) -> Loss:
        idx = [p.slot for p in batch]
        clean = x0[idx].float()
        sigma = sample_sigmas(len(batch), trainer.generator, shift=trainer.args.fsdp_flow_shift)
        if sigma_range is not None:  # only some experts train: their noise levels only
            sigma = sigma_range[0] + (sigma_range[1] - sigma_range[0]) * sigma
        noise = torch.randn(clean.shape, generator=trainer.generator)
        inputs = {"latents": noisy_latents(clean, noise, sigma), "timesteps": sigma * 1000.0, "sigmas": sigma}
        inputs |= {"clean_latents": clean, "noise": noise, "guidance_scale": None, "data_mask": data_mask}
        return loss_of(batch, inputs)

    metrics = trainer.step(pairs, micro)
    metrics["train_time"] = time.perf_counter() - start
    return metrics


def flow_matching_loss(trainer: Trainer, batch: list[Pair], inputs: dict[str, Any]) -> Loss:
    """`sft_loss` of the unguided velocity on `inputs` (see `flow_matching_step`)."""
    v = trainer.velocity(inputs["latents"], inputs["timesteps"], [p.sample for p in batch], None)
    # data_mask: only these elements carry data and are generated (e.g. LTX-2's video, not its audio; not TI2V's
    # condition frame)
    return sft_loss(v, inputs["clean_latents"], inputs["noise"], inputs["sigmas"], mask=inputs["data_mask"])
