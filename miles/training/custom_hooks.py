"""The trainer's user hooks: train-data conversion, train-pair expansion and `--loss-type custom_loss`.

Each flag takes a dotted path (`package.module.function`), loaded once when the trainer starts
(`miles.utils.hooks.load_function`). `Pair` is `miles.training.pairs.Pair(sample, step, slot, sigma)`
and `Sample` is `miles.rollout.types.Sample`.

--custom-convert-samples-to-train-data-path  (train rl, replay: every rollout loss)
    convert(args, samples: list[Sample]) -> list[list[Pair]]
    The whole samples -> train-data conversion: one list of pairs per optimizer step. It replaces both
    the cut into `--global-batch-size` windows and the expansion below; the trainer still splits each
    step's pairs over the dp ranks and into micro-batches. Every rank calls it with the same samples,
    so it must return the same steps on every rank.

--custom-expand-samples-to-train-pairs-path  (train rl, replay: every rollout loss)
    expand(args, samples: list[Sample]) -> list[Pair]
    Just the sample -> train-pair expansion of one optimizer window, in place of the built-in one
    (`expand_flow_grpo`, every recorded SDE transition, for policy_loss and custom_loss; the trained
    sigmas for nft). A policy_loss pair must name a recorded transition:
    `sample.trajectory.sde_step_indices[slot] == step`; an nft pair needs its `sigma`.

--custom-prepare-train-batch-path  (--loss-type custom_loss, rollout jobs)
    prepare(args, pairs: list[Pair]) -> dict
    Builds the DiT inputs of one micro-batch: `latents` [B, C, h, w] and `timesteps` [B] (required),
    `conditions` (the family's condition tensors, batch-first; default: the pairs' prompts),
    `negative_conditions` and `guidance_scale` (CFG when > 1; default: the pairs' samples' own).
    Every other key passes through to the loss. Without it the batch is the Flow-GRPO one
    (`miles.training.pairs.flow_grpo_batch`: latents, next_latents, timesteps, sigmas, next_sigmas,
    sigma_max, old_log_probs, advantages, guidance_scale, sde_type, noise_level, pairs); in `train sft`
    it is latents (noised), timesteps, sigmas, clean_latents, noise, data_mask (the family's `data_mask`: the
    elements the data carries, e.g. LTX-2's video channels; None for every other family; pass it as
    `sft_loss(..., mask=batch["data_mask"])`) and pairs.

--custom-loss-function-path  (--loss-type custom_loss)
    loss(args, batch: dict, model_output: Tensor) -> (loss: Tensor, metrics: dict[str, float])
    The loss formula only: the DiT forward stays in the trainer, which runs it on the batch (with CFG
    when `guidance_scale` > 1) and passes the fp32 velocity `model_output` [B, C, h, w]. Under a
    reference model (`--ref-mode lora_base|ema`) `batch["ref_model_output"]` holds the reference
    velocity (no grad). `loss` is a scalar that carries the graph; micro-batch losses are accumulated
    weighted by their share of the step's pairs, as for the built-in losses.

A hook that returns something else raises `HookError`, one line naming the flag and the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles.rollout.types import Sample
from miles.training.pairs import Pair, flow_grpo_batch, stack_conditions, windows
from miles.utils.hooks import load_function

if TYPE_CHECKING:
    from miles.training.trainer import Trainer

CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"
EXPAND_FLAG = "--custom-expand-samples-to-train-pairs-path"
PREPARE_FLAG = "--custom-prepare-train-batch-path"
LOSS_FLAG = "--custom-loss-function-path"


class HookError(ValueError):
    """A user hook returned something the trainer cannot use."""


@dataclass
class _Hook:
    flag: str
    path: str
    fn: Callable[..., Any]

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except HookError:
            raise
        except Exception as exc:  # the user's code raised: one line naming the hook, the traceback in the log
            from miles.utils.actors import log_hint

            detail = (str(exc).strip().splitlines() or [""])[-1]
            raise self.fail(f"raised {type(exc).__name__}: {detail}{log_hint()}") from exc

    def fail(self, what: str) -> HookError:
        return HookError(f"{self.flag} {self.path!r} {what}")


def _load(args: Any, dest: str, flag: str) -> _Hook | None:
    path = getattr(args, dest, None)
    return _Hook(flag, path, load_function(path, flag)) if path else None


class TrainHooks:
    """The hooks of one trainer (None where the flag is unset), with their return values checked."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.convert = _load(args, "custom_convert_samples_to_train_data_path", CONVERT_FLAG)
        self.expand = _load(args, "custom_expand_samples_to_train_pairs_path", EXPAND_FLAG)
        self.prepare = _load(args, "custom_prepare_train_batch_path", PREPARE_FLAG)
        self.loss = _load(args, "custom_loss_function_path", LOSS_FLAG) if args.loss_type == "custom_loss" else None

    # ---- samples -> train data -------------------------------------------------------------
    def train_data(
        self, samples: Sequence[Sample], expand: Callable[[list[Sample]], list[Pair]]
    ) -> Iterator[list[Pair]]:
        """The pairs of each optimizer step, lazily (the built-in `expand` may draw from the trainer's RNG)."""
        if self.convert is not None:
            steps = self.convert(self.args, list(samples))
            if not isinstance(steps, (list, tuple)):
                raise self.convert.fail(f"returned {_kind(steps)}; expected a list of steps, each a list of Pair")
            for i, step in enumerate(steps):
                yield self._check_pairs(step, self.convert, f"step {i}")
            return
        for window in windows(samples, self.args):
            if self.expand is None:
                yield expand(window)
            else:
                yield self._check_pairs(self.expand(self.args, window), self.expand, "")

    def _check_pairs(self, pairs: Any, hook: _Hook, where: str) -> list[Pair]:
        at = f" ({where})" if where else ""
        if not isinstance(pairs, (list, tuple)):
            raise hook.fail(f"returned {_kind(pairs)}{at}; expected a list of miles.training.pairs.Pair")
        loss_type = self.args.loss_type
        flow_grpo = loss_type == "policy_loss" or (loss_type == "custom_loss" and self.prepare is None)
        for i, pair in enumerate(pairs):
            if not isinstance(pair, Pair) or not isinstance(pair.sample, Sample):
                raise hook.fail(f"returned {_kind(pair)} as pair {i}{at}; expected a Pair of a Sample")
            problem = _pair_problem(pair, flow_grpo, nft=loss_type == "nft")
            if problem:
                raise hook.fail(f"returned an unusable pair {i}{at} (sample {pair.sample.index}): {problem}")
        return list(pairs)

    # ---- one custom_loss micro-batch ---------------------------------------------------------
    def custom_micro(
        self, trainer: Trainer, pairs: list[Pair], default: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Inputs (the prepare hook, else `default`, else the Flow-GRPO batch), the DiT forward(s), the loss hook."""
        if self.loss is None:
            raise HookError(f"--loss-type {self.args.loss_type} has no {LOSS_FLAG}")
        if self.prepare is not None:
            batch = self._check_inputs(self.prepare(self.args, pairs), pairs, self.prepare)
        else:
            batch = _with_conditions(default if default is not None else flow_grpo_batch(pairs), pairs)

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
        return self._check_loss(self.loss(self.args, batch, forward()))

    def _check_inputs(self, inputs: Any, pairs: list[Pair], hook: _Hook) -> dict[str, Any]:
        if not isinstance(inputs, dict):
            raise hook.fail(f"returned {_kind(inputs)}; expected a dict with 'latents' and 'timesteps' tensors")
        latents, timesteps = inputs.get("latents"), inputs.get("timesteps")
        if not isinstance(latents, torch.Tensor) or latents.ndim < 2:
            raise hook.fail(f"returned 'latents' = {_kind(latents)}; expected a tensor [B, C, h, w]")
        n = latents.shape[0]
        if not isinstance(timesteps, torch.Tensor) or tuple(timesteps.shape) != (n,):
            raise hook.fail(f"returned 'timesteps' = {_kind(timesteps)}; expected a tensor [{n}] (one per latent)")
        for key in ("conditions", "negative_conditions"):
            cond = inputs.get(key)
            if cond is None:
                continue
            if not isinstance(cond, dict) or not all(
                isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == n for v in cond.values()
            ):
                raise hook.fail(f"returned '{key}' = {_kind(cond)}; expected a dict of tensors with batch size {n}")
        scale = inputs.get("guidance_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise hook.fail(f"returned 'guidance_scale' = {_kind(scale)}; expected a number or None")
        try:
            return _with_conditions(dict(inputs), pairs)
        except ValueError as exc:
            raise hook.fail(f"left the conditions to the pairs' samples, which cannot give them: {exc}") from None

    def _check_loss(self, result: Any) -> tuple[torch.Tensor, dict[str, float]]:
        hook = self.loss
        assert hook is not None
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise hook.fail(f"returned {_kind(result)}; expected a tuple (loss tensor, metrics dict)")
        loss, metrics = result
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise hook.fail(f"returned loss = {_kind(loss)}; expected a scalar floating-point tensor")
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise hook.fail("returned a loss with no graph; it must be computed from model_output")
        if not isinstance(metrics, dict):
            raise hook.fail(f"returned metrics = {_kind(metrics)}; expected a dict of str -> number")
        out: dict[str, float] = {}
        for key, value in metrics.items():
            number = _number(value)
            if not isinstance(key, str) or number is None:
                raise hook.fail(f"returned metric {key!r} = {_kind(value)}; expected str -> number")
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


def _pair_problem(pair: Pair, flow_grpo: bool, nft: bool) -> str:
    trajectory = pair.sample.trajectory
    if (flow_grpo or nft) and trajectory is None:
        return "its sample has no trajectory"
    if flow_grpo:
        recorded = list(trajectory.sde_step_indices)  # type: ignore[union-attr]
        if not 0 <= pair.slot < len(recorded) or recorded[pair.slot] != pair.step:
            return f"step {pair.step} / slot {pair.slot} is not a recorded SDE transition (recorded: {recorded})"
    if nft and (pair.sigma is None or not 0.0 <= float(pair.sigma) <= 1.0):
        return f"an nft pair needs a sigma in [0, 1], got {pair.sigma!r}"
    return ""


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
