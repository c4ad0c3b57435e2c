"""`--loss-type policy_loss`: Flow-GRPO on the recorded SDE transitions of the rollout.

Each pair is one transition `x_t -> x_next` the engine sampled; the trainer's velocity at `x_t` goes through the
engine's own SDE kernel (`--sde-step-backend-path`, `miles.sampling.sde_backends`) to the transition's log-prob,
and `miles.algorithms.policy_loss` takes the clipped ratio against the engine's log-prob (or the recomputed one,
`--diffusion-recompute-old-log-prob`), with an optional KL to the reference (`--diffusion-kl-beta`). Under
`--diffusion-grpo-guard` the clipped log-ratio is RatioNorm's and each transition's term is weighted by `1/|dt|`
(`miles.algorithms.grpo_guard`), against the behaviour means the engine recorded with the transitions.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.algorithms.grpo_guard import ratio_bias, ratio_norm_log_ratio, step_weight
from miles.algorithms.policy_loss import policy_loss
from miles.core.sample import Sample
from miles.sampling.sde_backends import backend_step
from miles.training.methods.base import Loss, RolloutMethod
from miles.training.pairs import Pair, expand_flow_grpo, flow_grpo_batch, transition_problem
from miles.training.step_metrics import model_output_diffs


class FlowGrpo(RolloutMethod):
    def pairs(self, window: list[Sample]) -> list[Pair]:
        return expand_flow_grpo(window)

    def pair_problem(self, pair: Pair) -> str:
        problem = transition_problem(pair)
        if not problem and self.args.diffusion_grpo_guard:
            problem = guard_problem(pair)
        return problem

    def micro(self, batch: list[Pair]) -> Loss:
        trainer, args = self.trainer, self.args
        samples = [p.sample for p in batch]
        b = flow_grpo_batch(batch)
        x, x_next, ts, old, adv = b["latents"], b["next_latents"], b["timesteps"], b["old_log_probs"], b["advantages"]
        sig, sig_next, sig_max = b["sigmas"], b["next_sigmas"], b["sigma_max"]
        cfg, sde_type, noise = b["guidance_scale"], b["sde_type"], b["noise_level"]
        sde_mask = trainer.family.step_mask(tuple(x.shape[1:]))  # the engine's (LTX-2's audio, TI2V's frame 0)
        step_extra: dict[str, Any] = {} if sde_mask is None else {"mask": sde_mask}

        def step_of(v: torch.Tensor):
            return backend_step(  # the engine's kernel: --sde-step-backend-path, --diffusion-log-prob-no-const
                args,
                v,
                x,
                sig,
                sig_next,
                sde_type=sde_type,
                noise_level=noise,
                sigma_max=sig_max,
                prev_sample=x_next,
                **step_extra,
            )

        def scored(mean: torch.Tensor) -> torch.Tensor:  # the KL over the stochastic elements only
            return mean if sde_mask is None else mean.flatten(1)[:, sde_mask.to(mean.device).flatten()]

        # The reference forward runs first: swapping weights (EMA) must not happen under a live graph.
        mean_ref = None
        kl_beta = args.diffusion_kl_beta
        if kl_beta > 0:
            with torch.no_grad(), trainer.reference():
                mean_ref = scored(step_of(trainer.velocity(x, ts, samples, cfg)).mean)
        v = trainer.velocity(x, ts, samples, cfg)
        res = step_of(v)
        guard: dict[str, torch.Tensor] = {}
        mean_old = res.mean.detach() if args.diffusion_recompute_old_log_prob else None
        if args.diffusion_recompute_old_log_prob:
            old = res.log_prob.detach()
        if args.diffusion_grpo_guard:  # RatioNorm against the behaviour means, and 1/|dt| per transition
            if mean_old is None:
                mean_old = behaviour_means(batch).to(res.mean.device)
            mask = step_extra.get("mask")
            guard["log_ratio"] = ratio_norm_log_ratio(res.log_prob, old, res.mean, mean_old, res.std, mask)
            guard["weight"] = step_weight(sig, sig_next, res.log_prob)
        loss, metrics = policy_loss(
            res.log_prob,
            old,
            adv,
            clip_range=args.diffusion_clip_range,
            adv_clip_max=args.diffusion_adv_clip_max,
            kl_beta=kl_beta,
            mean_new=scored(res.mean),
            mean_ref=mean_ref,
            std_dev_t=res.std_dev_t,
            **guard,
        )
        if guard:
            with torch.no_grad():  # the vanilla log-ratio's bias that RatioNorm removed (0 on-policy and exact)
                metrics["ratio_bias"] = float(ratio_bias(res.mean, mean_old, res.std, step_extra.get("mask")).mean())
        metrics.update(model_output_diffs(v, batch))
        return loss, metrics


def guard_problem(pair: Pair) -> str:
    """Why `pair` has no behaviour mean for GRPO-Guard ('' when it has)."""
    means = pair.sample.trajectory.sde_means  # type: ignore[union-attr]
    if means is None or not 0 <= pair.slot < means.shape[0]:
        return (
            "--diffusion-grpo-guard needs the engine's step mean of each trained transition, and this sample has "
            "none (a rollout made without --diffusion-grpo-guard)"
        )
    return ""


def behaviour_means(batch: list[Pair]) -> torch.Tensor:
    """The engine's recorded step means of a micro-batch's transitions, `[B, *latent]` fp32."""
    for pair in batch:
        problem = guard_problem(pair)
        if problem:
            raise ValueError(problem)
    return torch.stack([p.sample.trajectory.sde_means[p.slot] for p in batch]).float()  # type: ignore[union-attr]
