"""`--loss-type custom_loss`: your loss formula on miles' forward, on rollouts (`train rl`, `replay`) or on dataset
latents (`train sft`).

Each flag takes a dotted path (`package.module.function`), loaded once when the trainer starts. On rollouts the
pairs are every recorded SDE transition (as Flow-GRPO's; the train-data hooks of `miles.training.custom_hooks` may
replace them); on dataset latents the inputs are flow matching's (`miles.training.flow_matching`).

--custom-prepare-train-batch-path  (--loss-type custom_loss, rollout jobs)
    prepare(args, pairs: list[Pair]) -> dict
    Builds the DiT inputs of one micro-batch: `latents` [B, C, h, w] and `timesteps` [B] (required),
    `conditions` (the family's condition tensors, batch-first; default: the pairs' prompts),
    `negative_conditions` and `guidance_scale` (CFG when > 1; default: the pairs' samples' own).
    Every other key passes through to the loss. Without it the batch is the Flow-GRPO one
    (`miles.training.pairs.flow_grpo_batch`: latents, next_latents, timesteps, sigmas, next_sigmas,
    sigma_max, old_log_probs, advantages, guidance_scale, sde_type, noise_level, pairs); in `train sft`
    it is latents (noised), timesteps, sigmas, clean_latents, noise, data_mask (the family's `loss_mask`: the
    elements the data carries and the model generates, e.g. LTX-2's video channels, Wan2.2 TI2V's frames after the
    condition frame; None for the other families; pass it as
    `sft_loss(..., mask=batch["data_mask"])`) and pairs.

--custom-loss-function-path  (--loss-type custom_loss)
    loss(args, batch: dict, model_output: Tensor) -> (loss: Tensor, metrics: dict[str, float])
    The loss formula only: the DiT forward stays in the trainer, which runs it on the batch (with CFG
    when `guidance_scale` > 1) and passes the fp32 velocity `model_output` [B, C, h, w]. Under a
    reference model (`--ref-mode lora_base|ema|frozen`) `batch["ref_model_output"]` holds the reference
    velocity (no grad). `loss` is a scalar that carries the graph; micro-batch losses are accumulated
    weighted by their share of the step's pairs, as for the built-in losses.

A hook that returns something else raises `HookError`, one line naming the flag and the hook.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.sample import Sample
from miles.training.custom_hooks import Hook, HookError, kind, load_hook
from miles.training.methods.base import Loss, RolloutMethod
from miles.training.pairs import Pair, expand_flow_grpo, flow_grpo_batch, stack_conditions, transition_problem

PREPARE_FLAG = "--custom-prepare-train-batch-path"
LOSS_FLAG = "--custom-loss-function-path"


class CustomLoss(RolloutMethod):
    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.prepare = load_hook(self.args, "custom_prepare_train_batch_path", PREPARE_FLAG)
        self.loss = load_hook(self.args, "custom_loss_function_path", LOSS_FLAG)

    def pairs(self, window: list[Sample]) -> list[Pair]:
        return expand_flow_grpo(window)

    def pair_problem(self, pair: Pair) -> str:
        # without a prepare hook the batch is the Flow-GRPO one: each pair must be a recorded transition
        return transition_problem(pair) if self.prepare is None else ""

    def micro(self, batch: list[Pair]) -> Loss:
        return self._micro(batch, None)

    def data_loss(self, batch: list[Pair], inputs: dict[str, Any]) -> Loss:
        return self._micro(batch, inputs)

    def _micro(self, pairs: list[Pair], default: dict[str, Any] | None) -> Loss:
        """Inputs (the prepare hook, else `default`, else the Flow-GRPO batch), the DiT forward(s), the loss hook."""
        if self.loss is None:
            raise HookError(f"--loss-type {self.args.loss_type} has no {LOSS_FLAG}")
        if self.prepare is not None:
            batch = _check_inputs(self.prepare(self.args, pairs), pairs, self.prepare)
        else:
            batch = _with_conditions(default if default is not None else flow_grpo_batch(pairs), pairs)
        trainer = self.trainer

        def forward() -> torch.Tensor:
            return trainer.dit_velocity(
                batch["latents"],
                batch["timesteps"],
                batch["conditions"],
                batch.get("negative_conditions"),
                batch.get("guidance_scale"),
            )

        # The reference forward runs first: swapping weights (EMA) must not happen under a live graph.
        if self.args.ref_mode not in (None, "none"):
            with torch.no_grad(), trainer.reference():
                batch["ref_model_output"] = forward()
        return _check_loss(self.loss, self.loss(self.args, batch, forward()))


def _check_inputs(inputs: Any, pairs: list[Pair], hook: Hook) -> dict[str, Any]:
    if not isinstance(inputs, dict):
        raise hook.fail(f"returned {kind(inputs)}; expected a dict with 'latents' and 'timesteps' tensors")
    latents, timesteps = inputs.get("latents"), inputs.get("timesteps")
    if not isinstance(latents, torch.Tensor) or latents.ndim < 2:
        raise hook.fail(f"returned 'latents' = {kind(latents)}; expected a tensor [B, C, h, w]")
    n = latents.shape[0]
    if not isinstance(timesteps, torch.Tensor) or tuple(timesteps.shape) != (n,):
        raise hook.fail(f"returned 'timesteps' = {kind(timesteps)}; expected a tensor [{n}] (one per latent)")
    for key in ("conditions", "negative_conditions"):
        cond = inputs.get(key)
        if cond is None:
            continue
        if not isinstance(cond, dict) or not all(
            isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == n for v in cond.values()
        ):
            raise hook.fail(f"returned '{key}' = {kind(cond)}; expected a dict of tensors with batch size {n}")
    scale = inputs.get("guidance_scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise hook.fail(f"returned 'guidance_scale' = {kind(scale)}; expected a number or None")
    try:
        return _with_conditions(dict(inputs), pairs)
    except ValueError as exc:
        raise hook.fail(f"left the conditions to the pairs' samples, which cannot give them: {exc}") from None


def _check_loss(hook: Hook, result: Any) -> Loss:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise hook.fail(f"returned {kind(result)}; expected a tuple (loss tensor, metrics dict)")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise hook.fail(f"returned loss = {kind(loss)}; expected a scalar floating-point tensor")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise hook.fail("returned a loss with no graph; it must be computed from model_output")
    if not isinstance(metrics, dict):
        raise hook.fail(f"returned metrics = {kind(metrics)}; expected a dict of str -> number")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        number = _number(value)
        if not isinstance(key, str) or number is None:
            raise hook.fail(f"returned metric {key!r} = {kind(value)}; expected str -> number")
        out[key] = number
    out.setdefault("loss", float(loss.detach()))
    return loss.reshape(()), out


def _with_conditions(batch: dict[str, Any], pairs: list[Pair]) -> dict[str, Any]:
    """Fill `conditions` (and `negative_conditions` under CFG) from the pairs' samples where missing."""
    samples = [p.sample for p in pairs]
    if batch.get("conditions") is None:
        batch["conditions"] = stack_conditions(samples, negative=False)
    if "guidance_scale" not in batch:
        batch["guidance_scale"] = samples[0].conditions.guidance_scale if samples[0].conditions else None
    scale = batch["guidance_scale"]
    if scale is not None and scale > 1.0 and batch.get("negative_conditions") is None:
        batch["negative_conditions"] = stack_conditions(samples, negative=True)
    return batch


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
