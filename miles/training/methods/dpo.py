"""`--loss-type dpo`: Diffusion-DPO for flow matching (`miles.algorithms.dpo`), online and offline.

Online (`train rl`, `replay`): each optimizer window's prompt groups give one pair each, the best against the worst
reward at `--reward-key` (`preference_pairs`: a tied group gives none, and is counted), of the samples' final
latents `trajectory.latents[-1]` with their own conditions. Offline (`train sft`): each preference row is a pair
(chosen, rejected) of dataset latents (`miles.training.preference_data`). A pair trains at
`--diffusion-dpo-num-timesteps` fresh (noise, sigma) draws per optimizer step, each one `Pair`: sigma logit-normal
on the `--fsdp-flow-shift` grid (`dpo_sigmas`, drawn when the window's pairs are made), the noise at the micro-step,
and both shared by the winner and the loser. The micro-step runs the reference first (`Trainer.reference`: the LoRA
base, a frozen copy of the start weights, or the EMA; no grad), then the trained forward, both unguided, the
winners and losers of the micro-batch in one batch.

The pairs per window vary (ties give none), so with several dp ranks the window is padded with zero-weight copies
to a multiple of the dp size: every rank runs the same number of forwards (FSDP's collectives stay in step), and the
real pairs are weighted `padded / real` so the gradient is their exact mean.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from miles.algorithms.dpo import PairSelection, denoising_error, dpo_loss, dpo_sigmas, preference_pairs
from miles.algorithms.sft_loss import noisy_latents
from miles.core.sample import Sample
from miles.training.methods.base import Loss, RolloutMethod
from miles.training.model import target_components
from miles.training.pairs import Pair

if TYPE_CHECKING:
    from miles.training.trainer import Trainer


def even_for_ranks(pairs: list[Pair], dp_size: int) -> list[Pair]:
    """`pairs` padded to a multiple of `dp_size` with zero-weight copies of its first pairs, the real ones weighted
    `padded / real` (unchanged when no padding is needed)."""
    real = len(pairs)
    short = -real % max(1, dp_size)
    if real == 0 or short == 0:
        return pairs
    scale = (real + short) / real
    out = [Pair(p.sample, p.step, p.slot, p.sigma, p.partner, p.weight * scale) for p in pairs]
    out += [Pair(p.sample, p.step, p.slot, p.sigma, p.partner, 0.0) for p in (pairs * short)[:short]]
    return out


class Dpo(RolloutMethod):
    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.selection = PairSelection()  # this rollout's pairing counts (reset by `train`)

    # ---- the pairs -------------------------------------------------------------------------------
    def _draws(self, units: list[tuple[Sample, Sample, int]]) -> list[Pair]:
        """K = --diffusion-dpo-num-timesteps pairs per (winner, loser, slot), each at its own sigma, evened over the
        dp ranks."""
        trainer, args = self.trainer, self.args
        k = int(args.diffusion_dpo_num_timesteps)
        sigmas = dpo_sigmas(len(units) * k, trainer.generator, shift=args.fsdp_flow_shift)
        sigma_range = trainer.family.trainable_sigma_range(target_components(args))
        if sigma_range is not None:  # only some experts train: their noise levels only
            sigmas = sigma_range[0] + (sigma_range[1] - sigma_range[0]) * sigmas
        values = sigmas.tolist()
        pairs = [
            Pair(winner, draw, slot, values[i * k + draw], partner=loser)
            for i, (winner, loser, slot) in enumerate(units)
            for draw in range(k)
        ]
        return even_for_ranks(pairs, trainer.dp_size)

    def pairs(self, window: list[Sample]) -> list[Pair]:
        kept = [s for s in window if not s.remove_sample and s.trajectory is not None]
        rewards = [s.scalar_reward(self.args.reward_key) for s in kept]
        selection = preference_pairs([s.group_index for s in kept], rewards)
        self.selection.pairs += selection.pairs
        self.selection.tied_groups += selection.tied_groups
        self.selection.single_groups += selection.single_groups
        return self._draws([(kept[win], kept[lose], -1) for win, lose in selection.pairs])

    def pair_problem(self, pair: Pair) -> str:
        if pair.partner is None:
            return "a dpo pair needs a partner (the loser sample)"
        if pair.sample.trajectory is None or pair.partner.trajectory is None:
            return "its winner or loser sample has no trajectory"
        if pair.sigma is None or not 0.0 <= float(pair.sigma) <= 1.0:
            return f"a dpo pair needs a sigma in [0, 1], got {pair.sigma!r}"
        if not pair.weight >= 0:
            return f"a dpo pair's weight must be >= 0, got {pair.weight!r}"
        return ""

    # ---- the loss --------------------------------------------------------------------------------
    def micro(self, batch: list[Pair]) -> Loss:
        x0_w = torch.stack([p.sample.trajectory.latents[-1] for p in batch]).float()  # type: ignore[union-attr]
        x0_l = torch.stack([p.partner.trajectory.latents[-1] for p in batch]).float()  # type: ignore[union-attr]
        return self.pair_loss(batch, x0_w, x0_l)

    def pair_loss(self, batch: list[Pair], x0_w: torch.Tensor, x0_l: torch.Tensor) -> Loss:
        """The DPO loss of a micro-batch of pairs with winner latents `x0_w` and loser latents `x0_l` `[P, ...]`."""
        trainer = self.trainer
        count = len(batch)
        sigma = torch.tensor([float(p.sigma) for p in batch], dtype=torch.float32)  # type: ignore[arg-type]
        noise = torch.randn(x0_w.shape, generator=trainer.generator)  # one draw per pair, for winner and loser
        x0 = torch.cat([x0_w, x0_l])
        noise2, sigma2 = torch.cat([noise, noise]), torch.cat([sigma, sigma])
        x_t = noisy_latents(x0, noise2, sigma2)
        timesteps = sigma2 * 1000.0
        samples = [p.sample for p in batch] + [p.partner or p.sample for p in batch]
        mask = trainer.family.loss_mask(tuple(x0.shape[1:]))
        with torch.no_grad(), trainer.reference():  # before the trained forward: weights swap under no graph
            e_ref = denoising_error(trainer.velocity(x_t, timesteps, samples, None), x0, noise2, mask)
        e_theta = denoising_error(trainer.velocity(x_t, timesteps, samples, None), x0, noise2, mask)
        weight = torch.tensor([p.weight for p in batch], dtype=e_theta.dtype)
        return dpo_loss(
            e_theta[:count],
            e_theta[count:],
            e_ref[:count],
            e_ref[count:],
            beta=float(self.args.diffusion_dpo_beta),
            weight=weight,
        )

    # ---- the entry points --------------------------------------------------------------------------
    def train(self, rollout_id: int, samples: list[Sample], *extra: Any) -> dict[str, float]:
        """One rollout's optimizer steps (`RolloutMethod.train`), plus the rollout's pairing counts: `pairs`,
        `tied_groups` (best == worst reward: no pair) and `single_groups` (one kept sample: no pair)."""
        self.selection = PairSelection()
        out = super().train(rollout_id, samples, *extra)
        out["pairs"] = float(len(self.selection.pairs))
        out["tied_groups"] = float(self.selection.tied_groups)
        out["single_groups"] = float(self.selection.single_groups)
        return out

    def train_sft(self, x0: torch.Tensor, conditions: list[Sample]) -> dict[str, float]:
        """One optimizer step on preference rows: `x0` `[B, 2, ...]` holds each row's chosen and rejected latents,
        `conditions` its caption's sample."""
        start = time.perf_counter()
        if x0.ndim < 3 or x0.shape[1] != 2 or x0.shape[0] != len(conditions):
            raise ValueError(
                f"--loss-type dpo trains on preference rows: x0 must be [B, 2, ...] (chosen, rejected) for "
                f"{len(conditions)} rows, got {tuple(x0.shape)}"
            )
        pairs = self._draws([(s, s, i) for i, s in enumerate(conditions)])

        def micro(batch: list[Pair]) -> Loss:
            rows = [p.slot for p in batch]
            return self.pair_loss(batch, x0[rows, 0].float(), x0[rows, 1].float())

        metrics = self.trainer.step(pairs, micro)
        metrics["pairs"] = float(len(conditions))
        metrics["train_time"] = time.perf_counter() - start
        return metrics
