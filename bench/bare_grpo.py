"""The bare-PyTorch Flow-GRPO micro-step the training benches compare miles' trainer with.

A plain `nn.Module` forward of one micro-batch of pairs (CFG as one doubled batch, or under `detach` the
unconditional half without grad), the SDE log-prob of the recorded
transition, the PPO-clip loss, and its backward scaled by the micro-batch's share of the optimizer step: no
sharding, no process group, no bookkeeping. Used by `bench/train_step.py` and `bench/phases.py`.
"""

from __future__ import annotations

from typing import Any

import torch


def bare_micro_step(model: torch.nn.Module, batch: list, n_pairs: int, settings: dict[str, Any]) -> None:
    """Forward, loss and backward of `batch` (pairs of `miles.training.pairs`), weighted `len(batch) / n_pairs`.
    `settings`: guidance_scale, sde_type, noise_level, clip_range, adv_clip_max, uncond_grad (`full`: CFG as one
    doubled batch with grad; `detach`: the unconditional half as its own forward without grad)."""
    from miles.algorithms.policy_loss import policy_loss
    from miles.sampling.sde import sde_step
    from miles.training.pairs import stack_conditions

    ss = [p.sample for p in batch]
    tr = [s.trajectory for s in ss]
    x = torch.stack([t.latents[p.step] for t, p in zip(tr, batch, strict=True)])
    x_next = torch.stack([t.latents[p.step + 1] for t, p in zip(tr, batch, strict=True)])
    ts = torch.stack([t.timesteps[p.step] for t, p in zip(tr, batch, strict=True)])
    sig = torch.stack([t.sigmas[p.step] for t, p in zip(tr, batch, strict=True)])
    sig_next = torch.stack([t.sigmas[p.step + 1] for t, p in zip(tr, batch, strict=True)])
    old = torch.stack([t.log_probs[p.slot] for t, p in zip(tr, batch, strict=True)])
    pos, neg = stack_conditions(ss, False), stack_conditions(ss, True)
    if settings.get("uncond_grad", "full") == "detach":  # the unconditional branch without grad, as flow_grpo's
        with torch.no_grad():
            v_neg = model(hidden_states=x, timestep=ts, return_dict=False, **neg)[0]
        v_pos = model(hidden_states=x, timestep=ts, return_dict=False, **pos)[0]
    else:
        cond = {k: torch.cat([neg[k], pos[k]]) for k in pos}
        out = model(hidden_states=torch.cat([x, x]), timestep=ts.repeat(2), return_dict=False, **cond)[0]
        v_neg, v_pos = out.chunk(2)
    v = v_neg + float(settings["guidance_scale"]) * (v_pos - v_neg)
    res = sde_step(
        v,
        x,
        sig,
        sig_next,
        sde_type=settings["sde_type"],
        noise_level=float(settings["noise_level"]),
        sigma_max=tr[0].sigmas[1],
        prev_sample=x_next,
    )
    adv = torch.tensor([s.advantage for s in ss])
    loss, _ = policy_loss(
        res.log_prob, old, adv, clip_range=settings["clip_range"], adv_clip_max=settings["adv_clip_max"]
    )
    (loss * len(batch) / n_pairs).backward()


def settings_of(args: Any) -> dict[str, Any]:
    """The micro-step's settings from a job's args."""
    return {
        "guidance_scale": args.diffusion_guidance_scale,
        "sde_type": args.diffusion_sde_type,
        "noise_level": args.diffusion_noise_level,
        "clip_range": args.diffusion_clip_range,
        "adv_clip_max": args.diffusion_adv_clip_max,
        "uncond_grad": args.diffusion_cfg_uncond_grad,
    }
