"""`--loss-type nft`: DiffusionNFT, forward-process fine-tuning on the rollout's clean samples.

Each pair is one sample's final latent `x0` at one trained noise level (`--diffusion-nft-timestep-fraction` of
the trajectory's sigmas, shuffled unless `--no-diffusion-nft-shuffle-timesteps`, within the trained experts'
range). The micro-step noises `x0` afresh, runs the old policy (the reference: EMA under the automatic
`--ref-mode ema`), the optional KL reference (the LoRA base) and the trained forward, all unguided, and takes
`miles.algorithms.nft.nft_loss` with the samples' advantages.
"""

from __future__ import annotations

import torch

from miles.algorithms.nft import nft_corrupt, nft_loss, nft_timesteps
from miles.core.sample import Sample
from miles.training.methods.base import Loss, RolloutMethod
from miles.training.model import adapters_off, target_components
from miles.training.pairs import Pair


class Nft(RolloutMethod):
    def pairs(self, window: list[Sample]) -> list[Pair]:
        trainer, args = self.trainer, self.args
        pairs = []
        sigma_range = trainer.family.trainable_sigma_range(target_components(args))
        for sample in window:
            if sample.remove_sample or sample.trajectory is None:
                continue
            sigmas = nft_timesteps(
                sample.trajectory.sigmas,
                args.diffusion_nft_timestep_fraction,
                shuffle=not args.no_diffusion_nft_shuffle_timesteps,
                generator=trainer.generator,
            )
            kept = [(i, float(s)) for i, s in enumerate(sigmas.reshape(-1).tolist())]
            if sigma_range is not None:  # only some experts train: the noise levels they denoise
                kept = [(i, s) for i, s in kept if sigma_range[0] <= s < sigma_range[1] or s == sigma_range[1] == 1.0]
            pairs.extend(Pair(sample, i, -1, s) for i, s in kept)
        return pairs

    def pair_problem(self, pair: Pair) -> str:
        if pair.sample.trajectory is None:
            return "its sample has no trajectory"
        if pair.sigma is None or not 0.0 <= float(pair.sigma) <= 1.0:
            return f"an nft pair needs a sigma in [0, 1], got {pair.sigma!r}"
        return ""

    def micro(self, batch: list[Pair]) -> Loss:
        trainer, args = self.trainer, self.args
        samples = [p.sample for p in batch]
        x0 = torch.stack([s.trajectory.latents[-1] for s in samples]).float()  # type: ignore[union-attr]
        t = torch.tensor([p.sigma for p in batch], dtype=torch.float32)
        noise = torch.randn(x0.shape, generator=trainer.generator)
        x_t = nft_corrupt(x0, t, noise)
        timesteps = t * 1000.0
        with torch.no_grad(), trainer.reference():  # before the trained forward: weights swap under no graph
            v_old = trainer.velocity(x_t, timesteps, samples, None)
        kl_beta = args.diffusion_kl_beta
        v_ref = None
        if kl_beta > 0:  # DiffusionNFT's KL reference: the LoRA base (adapters off; the config rules need --use-lora)
            with torch.no_grad(), adapters_off(trainer.model):
                v_ref = trainer.velocity(x_t, timesteps, samples, None)
        v_new = trainer.velocity(x_t, timesteps, samples, None)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        return nft_loss(
            x0,
            x_t,
            t,
            v_new,
            v_old,
            adv,
            beta=args.diffusion_nft_beta,
            adv_clip_max=args.diffusion_adv_clip_max,
            adaptive_weight=not args.no_diffusion_nft_adaptive_weight,
            v_ref=v_ref,
            kl_beta=kl_beta,
            mask=trainer.family.generated_mask(tuple(x0.shape[1:])),  # e.g. not TI2V's condition frame
        )
