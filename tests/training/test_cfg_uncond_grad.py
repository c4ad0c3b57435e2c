"""`--diffusion-cfg-uncond-grad`: the trained CFG forward with the unconditional branch's gradient kept (`full`, the
default) or detached (`detach`: its own forward without grad, the conditional one with grad).

Against an independent computation, `reference_guided_velocity`: the guided forward as it was before the flag (one
batched 2B forward where the family batches CFG, else two forwards, then `cfg_combine`), with `.detach()` on the
unconditional half when asked. `full` equals it to the bit (output and gradients); `detach` has its gradient to 1e-6
(relative) and `full`'s values to 1e-6. On the families' own forward (fast: sd3, which batches CFG, and qwen_image,
which does not and rescales its combine) and through the real trainer's Flow-GRPO and custom-loss micro-steps on a
tiny-sd3 rollout (slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.models.families import resolve_family

SCALE = 4.0
# relative. The family's gradients under `detach` are 7e-8 from the reference's (TOLERANCE); a B and a 2B forward
# round differently, so the velocities are 4-6e-7 apart and the trainer's gradients through the SDE log-prob 6e-7
# from the reference's (ROUNDING_TOLERANCE)
TOLERANCE = 1e-6
ROUNDING_TOLERANCE = 2e-6


def reference_guided_velocity(
    self: Any,
    transformer: Any,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    pos: dict[str, torch.Tensor],
    neg: dict[str, torch.Tensor] | None = None,
    cfg_scale: float | None = None,
    cfg_scale_2: float | None = None,
    uncond_grad: str = "full",
) -> torch.Tensor:
    """The guided forward before `--diffusion-cfg-uncond-grad` (b104c58's body), the unconditional half detached
    after the forward when `uncond_grad` is `detach` (the formula flow_grpo trains: its uncond prediction detached)."""
    if cfg_scale is None or cfg_scale <= 1.0:
        return self.forward_velocity(transformer, latents, timestep, pos).float()
    scale = self.row_guidance(transformer, latents, timestep, cfg_scale, cfg_scale_2)
    if self.cfg_batching:
        cond = {k: torch.cat([neg[k], pos[k]]) for k in pos}
        out = self.forward_velocity(transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), cond)
        v_neg, v_pos = out.float().chunk(2)
    else:
        v_pos = self.forward_velocity(transformer, latents, timestep, pos).float()
        v_neg = self.forward_velocity(transformer, latents, timestep, neg).float()
    if uncond_grad == "detach":
        v_neg = v_neg.detach()
    return self.cfg_combine(v_pos, v_neg, scale)


def reference_family(family: Any) -> Any:
    """`family` with its guided forward replaced by `reference_guided_velocity` (a subclass of its own class)."""
    cls = type(f"Reference{type(family).__name__}", (type(family),), {"guided_velocity": reference_guided_velocity})
    return cls()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            out[name] = g.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[k].flatten() for k in sorted(grads)])


# ---- the families' own guided forward (fast) ----------------------------------------------------------------------
def _sd3_case() -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor, dict, dict]:
    from miles.builtin.tiny.sd3 import make_transformer

    model = make_transformer(0)
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=gen)

    def cond() -> dict[str, torch.Tensor]:
        return {
            "encoder_hidden_states": torch.randn(3, 6, cfg.joint_attention_dim, generator=gen),
            "pooled_projections": torch.randn(3, cfg.pooled_projection_dim, generator=gen),
        }

    return resolve_family(None, family="sd3", env={}), model, x, torch.tensor([900.0, 500.0, 100.0]), cond(), cond()


def _qwen_case() -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor, dict, dict]:
    from miles.builtin.tiny.qwen_image import LATENT_CHANNELS, TEXT_HIDDEN, make_transformer

    model = make_transformer(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, LATENT_CHANNELS, 8, 8, generator=gen)

    def cond(length: int) -> dict[str, torch.Tensor]:  # the negative prompt is shorter: no batching
        mask = torch.ones(3, length, dtype=torch.long)
        mask[0, length - 2 :] = 0  # a padded row
        return {
            "encoder_hidden_states": torch.randn(3, length, TEXT_HIDDEN, generator=gen),
            "encoder_hidden_states_mask": mask,
        }

    return (
        resolve_family(None, family="qwen_image", env={}),
        model,
        x,
        torch.tensor([900.0, 500.0, 100.0]),
        cond(7),
        cond(4),
    )


CASES = {"sd3": _sd3_case, "qwen_image": _qwen_case}


def _run(
    family: Any, model: torch.nn.Module, x, t, pos, neg, **kw: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The guided velocity and the gradients of a fixed linear loss of it."""
    v = family.guided_velocity(model, x, t, pos, neg, SCALE, **kw)
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
    (v * weight).sum().backward()
    return v.detach(), _grads(model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_is_the_guided_forward_of_before_to_the_bit(name: str) -> None:
    family, model, x, t, pos, neg = CASES[name]()
    assert family.cfg_batching is (name == "sd3")  # one family batches its CFG branches, the other does not
    v_ref, g_ref = _run(reference_family(family), model, x, t, pos, neg)
    for kw in ({}, {"uncond_grad": "full"}):
        v, g = _run(family, model, x, t, pos, neg, **kw)
        assert torch.equal(v, v_ref)
        assert g.keys() == g_ref.keys() and all(torch.equal(g[k], g_ref[k]) for k in g)


@pytest.mark.parametrize("name", sorted(CASES))
def test_detach_has_the_detached_formulas_gradient_and_fulls_values(name: str) -> None:
    family, model, x, t, pos, neg = CASES[name]()
    v_full, g_full = _run(family, model, x, t, pos, neg, uncond_grad="full")
    v, g = _run(family, model, x, t, pos, neg, uncond_grad="detach")
    _, g_ref = _run(reference_family(family), model, x, t, pos, neg, uncond_grad="detach")
    assert relative(v, v_full) < ROUNDING_TOLERANCE
    assert g.keys() == g_ref.keys()
    assert relative(_flat(g), _flat(g_ref)) < TOLERANCE
    # the unconditional branch's share of the gradient is gone: far from full's
    assert relative(_flat(g), _flat(g_full)) > 0.01


def test_detach_without_grad_runs_what_full_runs() -> None:
    """A reference forward (no grad) under `detach` is `full`'s computation, to the bit."""
    family, model, x, t, pos, neg = _sd3_case()
    with torch.no_grad():
        full = family.guided_velocity(model, x, t, pos, neg, SCALE)
        detach = family.guided_velocity(model, x, t, pos, neg, SCALE, uncond_grad="detach")
    assert torch.equal(full, detach)
    with pytest.raises(ValueError, match="uncond_grad 'half'"):
        family.guided_velocity(model, x, t, pos, neg, SCALE, uncond_grad="half")


def test_a_family_whose_own_guided_forward_takes_no_uncond_grad_is_refused_under_detach() -> None:
    """The trainer passes `uncond_grad` only under `detach`, so a family that overrode `guided_velocity` before the
    flag keeps working under `full` and is refused by name (when the trainer starts) under `detach`."""
    from miles.core.errors import ConfigError

    sd3 = type(resolve_family(None, family="sd3", env={}))

    def before_the_flag(self, transformer, latents, timestep, pos, neg=None, cfg_scale=None, cfg_scale_2=None):
        return reference_guided_velocity(self, transformer, latents, timestep, pos, neg, cfg_scale, cfg_scale_2)

    old = type("OldSD3", (sd3,), {"guided_velocity": before_the_flag})()
    old.check_uncond_grad("full")
    with pytest.raises(ConfigError, match=r"--diffusion-cfg-uncond-grad detach: model family 'sd3' overrides"):
        old.check_uncond_grad("detach")
    for family in (sd3(), reference_family(sd3())):
        family.check_uncond_grad("detach")


# ---- through the trainer on a tiny-sd3 rollout (slow) ------------------------------------------------------------
def _micro(trainer: Any, pairs: list, mode: str) -> tuple[float, torch.Tensor]:
    """One micro-batch of the trainer's method under `--diffusion-cfg-uncond-grad mode`: loss and gradients."""
    base = trainer.args
    trainer.args = base.with_values({"diffusion_cfg_uncond_grad": mode}, "cli")
    try:
        loss, _ = trainer.method.micro(pairs)
        loss.backward()
    finally:
        trainer.args = base
    return float(loss.detach()), _flat(_grads(trainer.model))


def _log_probs(trainer: Any, pairs: list, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained forward's velocity and the recorded transitions' log-probs under `mode`, computed with grad on
    (where `detach` takes its own path), as Flow-GRPO's micro-step computes them."""
    from miles.sampling.sde_backends import backend_step
    from miles.training.pairs import flow_grpo_batch

    base = trainer.args
    trainer.args = base.with_values({"diffusion_cfg_uncond_grad": mode}, "cli")
    try:
        b = flow_grpo_batch(pairs)
        v = trainer.velocity(b["latents"], b["timesteps"], [p.sample for p in pairs], b["guidance_scale"])
        assert v.requires_grad
        res = backend_step(
            trainer.args,
            v,
            b["latents"],
            b["sigmas"],
            b["next_sigmas"],
            sde_type=b["sde_type"],
            noise_level=b["noise_level"],
            sigma_max=b["sigma_max"],
            prev_sample=b["next_latents"],
        )
    finally:
        trainer.args = base
    return v.detach(), res.log_prob.detach()


@pytest.mark.slow
@pytest.mark.parametrize(
    "cli",
    [
        {},  # policy_loss (Flow-GRPO and its variants share its micro-step)
        {"loss_type": "custom_loss", "custom_loss_function_path": "train_hooks_helpers.flow_grpo_loss"},
    ],
    ids=["policy_loss", "custom_loss"],
)
def test_the_trainers_step_under_full_and_detach(tiny_sd3_dir: Path, rollout, cli: dict[str, Any]) -> None:
    from miles.training.trainer import Trainer

    _, batch = rollout
    trainer = Trainer(trainer_args(tiny_sd3_dir, **cli), master_port=free_port())
    pairs = trainer.method.pairs([s for s in batch.samples if not s.remove_sample])[:6]
    assert all(p.sample.conditions.guidance_scale == SCALE for p in pairs)  # the rollout's CFG is trained
    family = trainer.family
    loss_full, g_full = _micro(trainer, pairs, "full")
    loss_detach, g_detach = _micro(trainer, pairs, "detach")
    trainer.family = reference_family(family)  # the same trainer and method on the independent forward
    try:
        loss_ref, g_ref = _micro(trainer, pairs, "full")
        loss_ref_detach, g_ref_detach = _micro(trainer, pairs, "detach")
    finally:
        trainer.family = family
    assert loss_full == loss_ref and torch.equal(g_full, g_ref)  # full: today's computation, to the bit
    assert loss_ref_detach == loss_full  # the reference's detach changes the gradient only
    assert abs(loss_detach - loss_full) <= ROUNDING_TOLERANCE * abs(loss_full)
    assert relative(g_detach, g_ref_detach) < ROUNDING_TOLERANCE
    assert relative(g_detach, g_full) > 0.01
    (v_full, lp_full), (v_detach, lp_detach) = _log_probs(trainer, pairs, "full"), _log_probs(trainer, pairs, "detach")
    assert relative(v_detach, v_full) < ROUNDING_TOLERANCE and relative(lp_detach, lp_full) < ROUNDING_TOLERANCE
    trainer.model.zero_grad(set_to_none=True)
