"""`--loss-type dmd2` and `dmd2_critic`: DMD2's student step and its critic group's iteration, on the role-agnostic
Trainer (`Dmd2Generator.train`, `Dmd2Critic.train`).

A trainer becomes the critic group only through its args (`--loss-type dmd2_critic`,
`--hf-checkpoint` = the teacher): its model is the fake score, initialised from the teacher, and
it also holds the frozen teacher (a second copy, eval mode, no grad, in no optimizer; with a LoRA
critic the teacher is the critic with its adapter switched off) and, with
`--dmd2-gan-loss-weight > 0`, the GAN head. One critic iteration (`critic_iteration`):

1. on generator iterations only, with the critic's *pre-update* weights and no parameter gradients,
   the external data for the student's samples x (the engine's x0 at the stop step, detached)::

       sigma ~ dm_timesteps([--dmd2-min-step-ratio, --dmd2-max-step-ratio]),  eps ~ N(0, I)
       x_t = (1 - sigma) x + sigma eps
       x0_real = x_t - sigma * cfg(teacher, --dmd2-real-guidance-scale)      x0_fake = x_t - sigma * critic(x_t)

   plus, with the GAN head, d softplus(-D(x)) / dx per sample (through the critic's features);
2. one critic optimizer step: flow matching on the detached samples, sigma over the full range
   [0, 999] / 1000, no CFG, plus `w * L_D` (real latents of the prompt data's images vs the samples).

The student's step (`generator_step`) recomputes x0_gen = x_{t_k} - sigma_k * v(x_{t_k}, t_k) with
grad (reporting its distance to the engine's x0), takes `dmd2_generator_loss` against the external
x0_real / x0_fake, and adds `w * sum(x0_gen * sg(dL_G/dx))` for the GAN (the same stop-gradient trick:
its gradient is the GAN generator loss's). The two groups never share parameters, so each step only
moves its own weights.

External data: `{sample index: {"sigma", "noise", "x0", "x0_real", "x0_fake"[, "gan_grad", "gan_loss"]}}`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from miles.algorithms.dmd2 import (
    add_noise,
    dm_timesteps,
    dmd2_critic_loss,
    dmd2_generator_loss,
    gan_discriminator_loss,
    x0_from_velocity,
)
from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.training.methods.base import TrainMethod
from miles.training.pairs import Pair, dp_shard, stack_conditions

if TYPE_CHECKING:
    from miles.training.trainer import Trainer

ExternalData = dict[int, dict[str, torch.Tensor]]


# --------------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------------


def generator_inputs(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(x_{t_k}, t_k, sigma_k, x0_engine)` of stopped student rollouts (`miles.rollout.dmd2.engine` layout)."""
    trajs = [s.trajectory for s in samples]
    if any(t is None or t.latents.shape[0] < 2 for t in trajs):
        raise ValueError("a DMD2 sample needs the student's stopped trajectory (input latents and its x0)")
    x = torch.stack([t.latents[-2] for t in trajs]).float()  # type: ignore[union-attr]
    ts = torch.stack([t.timesteps[-1] for t in trajs]).float()  # type: ignore[union-attr]
    sig = torch.stack([t.sigmas[-2] for t in trajs]).float()  # type: ignore[union-attr]
    x0 = torch.stack([t.latents[-1] for t in trajs]).float()  # type: ignore[union-attr]
    return x, ts, sig, x0


def model_velocity(
    trainer: Trainer, model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, samples: Sequence[Sample], cfg: float
) -> torch.Tensor:
    """`model`'s velocity (the trainer's family and forward dtype), with CFG when `cfg > 1`."""
    family, dtype = trainer.family, trainer.forward_dtype
    pos = stack_conditions(samples, negative=False, family=family)
    neg = stack_conditions(samples, negative=True, family=family) if cfg > 1.0 else None
    return family.guided_velocity(model, x.to(dtype), t, pos, neg, cfg)


# --------------------------------------------------------------------------------------------------
# The critic group's extra state: the frozen teacher and the GAN head
# --------------------------------------------------------------------------------------------------


class GanHead(torch.nn.Module):
    """A small classifier on the critic's features: the image tokens' hidden states after a middle
    transformer block (a forward hook), mean-pooled over tokens, then an MLP to one logit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.LayerNorm(width),
            torch.nn.Linear(width, width),
            torch.nn.SiLU(),
            torch.nn.Linear(width, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float().mean(dim=1)).squeeze(-1)


class FeatureTap:
    """Keeps the last output of one block of the critic (the image-token hidden states)."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self.handle = block.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        self.value = output[-1] if isinstance(output, tuple) else output

    def take(self) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("the GAN feature hook saw no forward")
        value, self.value = self.value, None
        return value


@dataclass
class RealLatents:
    """VAE latents of the prompt data's images, with their captions' conditions (the GAN's real side)."""

    latents: torch.Tensor
    samples: list[Sample]

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, list[Sample]]:
        rows = torch.randint(0, self.latents.shape[0], (n,), generator=generator).tolist()
        return self.latents[rows], [self.samples[r] for r in rows]


@dataclass
class CriticState:
    teacher: torch.nn.Module | None  # None: the LoRA critic with its adapter off
    head: GanHead | None = None
    head_optimizer: torch.optim.Optimizer | None = None
    tap: FeatureTap | None = None
    real: RealLatents | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    blocks = list(getattr(model, "transformer_blocks", []))
    if not blocks:
        raise ConfigError("--dmd2-gan-loss-weight > 0 needs a DiT with transformer_blocks (the GAN feature tap)")
    return blocks


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def load_teacher(trainer: Trainer) -> torch.nn.Module | None:
    """The frozen teacher: `--hf-checkpoint` of the critic's args (= --teacher-checkpoint), no grad, eval mode."""
    from miles.training.model import load_transformer, shard

    if trainer.args.use_lora:
        return None  # the critic's LoRA base is the teacher
    model = load_transformer(trainer.args, trainer.family).eval()
    model.requires_grad_(False)
    if hasattr(model, "disable_gradient_checkpointing"):
        model.disable_gradient_checkpointing()
    return shard(model, trainer.args, block_lists=trainer.family.fsdp_block_lists)


def real_latents(args: Any) -> RealLatents:
    """Encode the prompt data's images (rows with an 'image' field, e.g. digits:sft) for the GAN's real side."""
    from miles.training.sft_data import encode_sft_dataset

    data = encode_sft_dataset(args)
    samples = [
        Sample(index=i, group_index=i, prompt=p, conditions=c)
        for i, (p, c) in enumerate(zip(data.prompts, data.conditions, strict=True))
    ]
    return RealLatents(data.latents, samples)


def critic_state(trainer: Trainer) -> CriticState:
    """The critic group's teacher (and GAN head), built on first use and kept by the trainer's critic method."""
    args, owner = trainer.args, trainer.method
    if not isinstance(owner, Dmd2Critic):
        raise ConfigError(
            f"the DMD2 critic iteration needs --loss-type dmd2_critic, this trainer has {args.loss_type}"
        )
    if owner.state is not None:
        return owner.state
    state = CriticState(teacher=load_teacher(trainer))
    if args.dmd2_gan_loss_weight > 0:
        from miles.training.optim import build_optimizer

        blocks = _blocks(trainer.model)
        width = int(trainer.model.config.num_attention_heads * trainer.model.config.attention_head_dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed + 1)
            state.head = GanHead(width).to(_device(trainer.model))
        state.head_optimizer = build_optimizer(state.head.parameters(), args)
        state.tap = FeatureTap(blocks[len(blocks) // 2])
        state.real = real_latents(args)
    owner.state = state
    return state


@contextlib.contextmanager
def _teacher(trainer: Trainer, state: CriticState) -> Iterator[torch.nn.Module]:
    if state.teacher is not None:
        yield state.teacher
        return
    from miles.training.model import adapters_off

    with adapters_off(trainer.model) as base:  # the critic's base: the teacher
        yield base


# --------------------------------------------------------------------------------------------------
# The critic group's iteration
# --------------------------------------------------------------------------------------------------


def score_samples(trainer: Trainer, samples: Sequence[Sample]) -> ExternalData:
    """The external data for `samples` with the current (pre-update) critic and the frozen teacher."""
    args, state = trainer.args, critic_state(trainer)
    cfg = float(args.dmd2_real_guidance_scale or 1.0)
    size = max(1, int(args.micro_batch_size))
    out: ExternalData = {}
    for start in range(0, len(samples), size):
        batch = list(samples[start : start + size])
        _, _, _, x0 = generator_inputs(batch)
        sigma = dm_timesteps(len(batch), args.dmd2_min_step_ratio, args.dmd2_max_step_ratio, trainer.generator)
        noise = torch.randn(x0.shape, generator=trainer.generator)
        x_t = add_noise(x0, noise, sigma)
        t = sigma * 1000.0
        with torch.no_grad():
            with _teacher(trainer, state) as teacher:
                x0_real = x0_from_velocity(x_t, sigma, model_velocity(trainer, teacher, x_t, t, batch, cfg))
            x0_fake = x0_from_velocity(x_t, sigma, model_velocity(trainer, trainer.model, x_t, t, batch, 1.0))
        rows = {"sigma": sigma, "noise": noise, "x0": x0, "x0_real": x0_real.float(), "x0_fake": x0_fake.float()}
        if state.head is not None:
            rows.update(_gan_generator_grad(trainer, state, x0, batch))
        for i, sample in enumerate(batch):
            out[sample.index] = {k: v[i].detach().cpu() for k, v in rows.items()}
    return out


def _gan_logits(trainer: Trainer, state: CriticState, x: torch.Tensor, samples: Sequence[Sample]) -> torch.Tensor:
    """D(x): the critic's features at a diffusion-GAN noised x (sigma over the full range), then the head."""
    assert state.head is not None and state.tap is not None
    sigma = dm_timesteps(x.shape[0], 0.0, 1.0, trainer.generator)
    noise = torch.randn(x.shape, generator=trainer.generator)
    model_velocity(trainer, trainer.model, add_noise(x, noise, sigma), sigma * 1000.0, samples, 1.0)
    return state.head(state.tap.take())


def _gan_generator_grad(
    trainer: Trainer, state: CriticState, x0: torch.Tensor, samples: Sequence[Sample]
) -> dict[str, torch.Tensor]:
    """Per sample, `softplus(-D(x))` and its gradient in x, through the frozen critic and head (no param grads)."""
    x = x0.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        per_sample = torch.nn.functional.softplus(-_gan_logits(trainer, state, x, samples))
        (grad,) = torch.autograd.grad(per_sample.sum(), [x])
    return {"gan_grad": grad.detach(), "gan_loss": per_sample.detach()}


def critic_iteration(
    trainer: Trainer, rollout_id: int, samples: list[Sample], with_external: bool
) -> tuple[dict[str, float], ExternalData | None]:
    """On generator iterations the external data first (pre-update weights), then one critic step."""
    start = time.perf_counter()
    args, state = trainer.args, critic_state(trainer)
    external = None
    if with_external:
        mine = dp_shard(samples, trainer.dp_rank, trainer.dp_size, args.train_dp_split_mode)
        external = score_samples(trainer, mine)
    scored = time.perf_counter()
    _, _, _, x0_all = generator_inputs(samples)
    pairs = [Pair(s, 0, i) for i, s in enumerate(samples)]
    weight = float(args.dmd2_gan_loss_weight)

    def micro(batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        clean = x0_all[[p.slot for p in batch]]
        group = [p.sample for p in batch]
        sigma = dm_timesteps(len(batch), 0.0, 1.0, trainer.generator)
        noise = torch.randn(clean.shape, generator=trainer.generator)
        v = model_velocity(trainer, trainer.model, add_noise(clean, noise, sigma), sigma * 1000.0, group, 1.0)
        loss, metrics = dmd2_critic_loss(v, noise, clean, sigma)
        if state.head is not None and state.real is not None:
            assert state.tap is not None
            logits_fake = state.head(state.tap.take())  # the flow-matching forward is the noised fake
            real, real_samples = state.real.draw(len(batch), trainer.generator)
            logits_real = _gan_logits(trainer, state, real, real_samples)
            d_loss, d_metrics = gan_discriminator_loss(logits_fake, logits_real)
            metrics = {**metrics, **{f"gan_d_{k}": v for k, v in d_metrics.items()}}
            loss = loss + weight * d_loss
        return loss, metrics

    metrics = trainer.step(pairs, micro)
    if state.head_optimizer is not None and not args.debug_skip_optimizer_step:
        from miles.training.optim import clip_grad_norm

        assert state.head is not None
        metrics["gan_head_grad_norm"] = float(clip_grad_norm(list(state.head.parameters()), args.clip_grad))
        state.head_optimizer.step()
        state.head_optimizer.zero_grad(set_to_none=True)
    metrics["score_time"] = scored - start
    metrics["train_time"] = time.perf_counter() - start
    return metrics, external


# --------------------------------------------------------------------------------------------------
# The student's step
# --------------------------------------------------------------------------------------------------


def generator_step(
    trainer: Trainer, rollout_id: int, samples: list[Sample], external: ExternalData
) -> dict[str, float]:
    """One student optimizer step on the distribution-matching loss (+ the GAN generator loss)."""
    start = time.perf_counter()
    missing = [s.index for s in samples if s.index not in external]
    if missing:
        raise ValueError(f"no external data (critic group scores) for samples {missing[:5]}")
    weight = float(trainer.args.dmd2_gan_loss_weight)
    pairs = [Pair(s, 0, i) for i, s in enumerate(samples)]

    def micro(batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        group = [p.sample for p in batch]
        x, t, sigma, x0_engine = generator_inputs(group)
        x0_gen = x0_from_velocity(x, sigma, trainer.velocity(x, t, group, None))
        ext = [external[s.index] for s in group]
        x0_real = torch.stack([e["x0_real"] for e in ext])
        x0_fake = torch.stack([e["x0_fake"] for e in ext])
        loss, metrics = dmd2_generator_loss(x0_gen, x0_real, x0_fake)
        metrics = {"dm_loss": metrics.pop("loss"), **metrics}
        metrics["x0_gen_mean_abs_diff"] = float((x0_gen.detach() - x0_engine).abs().mean())
        metrics["stop_timestep"] = float(t.mean())
        total = float(loss.detach())
        if weight > 0:
            if "gan_grad" not in ext[0]:
                raise ConfigError("--dmd2-gan-loss-weight > 0 on the actor needs the critic's GAN head too")
            grad = torch.stack([e["gan_grad"] for e in ext]).to(x0_gen.dtype)
            gan_value = float(torch.stack([e["gan_loss"] for e in ext]).mean())
            loss = loss + weight * (x0_gen * grad).flatten(1).sum(1).mean()
            metrics["gan_g_loss"] = gan_value
            total += weight * gan_value
        metrics["loss"] = total
        return loss, metrics

    metrics = trainer.step(pairs, micro)
    metrics["train_time"] = time.perf_counter() - start
    return metrics


# --------------------------------------------------------------------------------------------------
# The two methods
# --------------------------------------------------------------------------------------------------


class Dmd2Critic(TrainMethod):
    """The critic group: `train(rollout_id, samples, with_external)` -> (metrics, external data or None)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.state: CriticState | None = None  # built on the first iteration (`critic_state`)

    def train(
        self, rollout_id: int, samples: list[Sample], *extra: Any
    ) -> tuple[dict[str, float], ExternalData | None]:
        (with_external,) = extra
        return critic_iteration(self.trainer, rollout_id, samples, bool(with_external))


class Dmd2Generator(TrainMethod):
    """The student: `train(rollout_id, samples, external_data)` -> metrics, against the critic group's scores."""

    def train(self, rollout_id: int, samples: list[Sample], *extra: Any) -> dict[str, float]:
        (external,) = extra
        return generator_step(self.trainer, rollout_id, samples, external)
