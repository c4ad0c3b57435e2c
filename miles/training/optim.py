"""AdamW, the Megatron-style learning-rate schedule and gradient clipping.

Schedule (`MilesLRScheduler.get_lr`, with `n` = optimizer steps taken so far):

- warmup: if `warmup_steps > 0` and `n <= warmup_steps`: `init + (lr - init) * n / warmup_steps`
  (`--lr-warmup-init` -> `--lr`; the warmup length is `--lr-warmup-iters`, or `--lr-warmup-fraction` times the
  decay steps);
- `constant`: `lr` after warmup;
- past `decay_steps` (`--lr-decay-iters`, default: the whole run): `min_lr`;
- `inverse-square-root`: `max(min_lr, lr * sqrt(max(warmup, 1)) / sqrt(max(n, 1)))`;
- `linear` / `cosine`: `min_lr + coeff * (lr - min_lr)` with `r = (n - warmup) / (decay_steps - warmup)`,
  `coeff = 1 - r` or `0.5 * (cos(pi * r) + 1)`;
- `WSD` (warmup-stable-decay): `coeff = 1` until `decay_steps - wsd_decay_steps`, then over the last
  `wsd_decay_steps` (`--lr-wsd-decay-iters`) with `r` the fraction of that phase done, `--lr-wsd-decay-style`:
  linear `1 - r`, cosine `0.5 * (cos(pi * r) + 1)`, exponential `2 * 0.5**r - 1`, minus_sqrt `1 - sqrt(r)`.

The learning rate set on the optimizer is `get_lr()` at the current step count: the constructor sets the step-0
value, and the training loop calls `scheduler.step()` after each `optimizer.step()` (as Megatron does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from miles.core.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
DEFAULT_WSD_DECAY_STYLE = "exponential"  # Megatron's default for --lr-wsd-decay-style

# The schedule settings a checkpoint records; `--use-checkpoint-lr-scheduler` / `--override-lr-scheduler`
# decide which side wins for each of them on resume.
_SETTINGS = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("init_lr", "--lr-warmup-init"),
    ("warmup_steps", "--lr-warmup-iters/--lr-warmup-fraction"),
    ("decay_steps", "--lr-decay-iters"),
    ("decay_style", "--lr-decay-style"),
    ("wsd_decay_steps", "--lr-wsd-decay-iters"),
    ("wsd_decay_style", "--lr-wsd-decay-style"),
)


def build_optimizer(params: Iterable[Any], args: Any) -> torch.optim.AdamW:
    """AdamW over `params` (tensors or param-group dicts) with `--lr`, `--adam-beta1/2`, `--adam-eps`,
    `--weight-decay`. Plain tensors that do not require grad (frozen LoRA base weights) are left out."""
    if args.optimizer != "adam":
        raise ConfigError(f"--optimizer {args.optimizer!r}: only 'adam' (AdamW) is supported")
    items = list(params)
    if items and not isinstance(items[0], dict):
        items = [p for p in items if p.requires_grad]
    if not items:
        raise ValueError("build_optimizer: no trainable parameters (nothing requires grad)")
    return torch.optim.AdamW(
        items,
        lr=float(args.lr),
        betas=(float(args.adam_beta1), float(args.adam_beta2)),
        eps=float(args.adam_eps),
        weight_decay=float(args.weight_decay),
    )


class MilesLRScheduler:
    """Megatron's `OptimizerParamScheduler` for the learning rate: warmup, then one of `DECAY_STYLES`.

    Every param group of `optimizer` gets the same learning rate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float = 0.0,
        init_lr: float = 0.0,
        warmup_steps: int = 0,
        decay_steps: int,
        decay_style: str = "constant",
        wsd_decay_steps: int | None = None,
        wsd_decay_style: str | None = None,
        use_checkpoint_lr_scheduler: bool = True,
        override_lr_scheduler: bool = False,
    ) -> None:
        if use_checkpoint_lr_scheduler and override_lr_scheduler:
            raise ConfigError(
                "--override-lr-scheduler and --use-checkpoint-lr-scheduler are both on: pick one "
                "(add --no-use-checkpoint-lr-scheduler to take the schedule from the command line)"
            )
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.wsd_decay_style = wsd_decay_style
        if decay_style == "WSD" and wsd_decay_style is None:
            self.wsd_decay_style = DEFAULT_WSD_DECAY_STYLE
        self.use_checkpoint_lr_scheduler = bool(use_checkpoint_lr_scheduler)
        self.override_lr_scheduler = bool(override_lr_scheduler)
        self.num_steps = 0
        self._validate()
        self._apply()

    # ---- schedule ----------------------------------------------------------------------------------------

    def _validate(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.decay_style!r}: expected one of {', '.join(DECAY_STYLES)}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} must lie in [0, --lr {self.max_lr:g}]")
        if self.init_lr < 0 or self.warmup_steps < 0:
            raise ConfigError("--lr-warmup-init and --lr-warmup-iters must be >= 0")
        if self.decay_style == "constant":
            return
        if self.decay_steps <= 0:
            raise ConfigError(
                f"--lr-decay-style {self.decay_style} needs a positive decay length; "
                f"--lr-decay-iters (or the run length) is {self.decay_steps}"
            )
        if self.decay_style != "inverse-square-root" and self.warmup_steps >= self.decay_steps:
            raise ConfigError(
                f"the warmup ({self.warmup_steps} steps) must be shorter than the decay (--lr-decay-iters or "
                f"the run length: {self.decay_steps} steps) for --lr-decay-style {self.decay_style}"
            )
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final decay)")
            if not 0 < self.wsd_decay_steps <= self.decay_steps:
                raise ConfigError(
                    f"--lr-wsd-decay-iters {self.wsd_decay_steps} must lie in [1, decay steps {self.decay_steps}]"
                )
            if self.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ConfigError(
                    f"--lr-wsd-decay-style {self.wsd_decay_style!r}: expected one of {', '.join(WSD_DECAY_STYLES)}"
                )

    def lr_at(self, num_steps: int) -> float:
        """The learning rate after `num_steps` optimizer steps."""
        n = num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            lr = self.max_lr * math.sqrt(max(self.warmup_steps, 1)) / math.sqrt(max(n, 1))
            return max(self.min_lr, lr)
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            assert self.wsd_decay_steps is not None
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = (n - anneal_start) / self.wsd_decay_steps
                if self.wsd_decay_style == "linear":
                    coeff = 1.0 - r
                elif self.wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                elif self.wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, r) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(r)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_lr(self) -> float:
        """The learning rate at the current step count (what the optimizer holds now)."""
        return self.lr_at(self.num_steps)

    def get_last_lr(self) -> list[float]:
        """Per param group, like torch's schedulers."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1) -> float:
        """Count `increment` optimizer steps and set the new learning rate; returns it."""
        self.num_steps += int(increment)
        self._apply()
        return self.get_lr()

    # ---- checkpoint --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name, _ in _SETTINGS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the step count always comes from `state`. The schedule settings come from `state` with
        `--use-checkpoint-lr-scheduler`, from the command line with `--override-lr-scheduler`; with neither,
        the two must agree. Sets the optimizer's learning rate, so call it after `optimizer.load_state_dict`."""
        mismatches = []
        for name, flag in _SETTINGS:
            if name not in state:
                continue
            mine, theirs = getattr(self, name), state[name]
            if self.override_lr_scheduler:
                continue
            if self.use_checkpoint_lr_scheduler:
                setattr(self, name, theirs)
            elif mine != theirs:
                mismatches.append(f"{flag}: command line {mine!r}, checkpoint {theirs!r}")
        if mismatches:
            raise ConfigError(
                "the learning-rate schedule differs from the checkpoint's ("
                + "; ".join(mismatches)
                + "); pass --use-checkpoint-lr-scheduler to keep the checkpoint's "
                "or --override-lr-scheduler to use the command line's"
            )
        self._validate()
        self.num_steps = int(state["num_steps"])
        self._apply()


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args: Any, total_steps: int) -> MilesLRScheduler:
    """The schedule from the `Optimizer and schedule` flags; `total_steps` = optimizer steps in the whole run
    (the default decay length)."""
    decay_steps = args.lr_decay_iters if args.lr_decay_iters is not None else total_steps
    warmup_iters = int(args.lr_warmup_iters or 0)
    fraction = args.lr_warmup_fraction
    if fraction is not None:
        if warmup_iters > 0:
            raise ConfigError(
                f"--lr-warmup-fraction {fraction:g} and --lr-warmup-iters {warmup_iters} both set the warmup length; "
                "use one"
            )
        warmup_iters = int(fraction * decay_steps)
    return MilesLRScheduler(
        optimizer,
        max_lr=args.lr,
        min_lr=args.min_lr,
        init_lr=args.lr_warmup_init,
        warmup_steps=warmup_iters,
        decay_steps=int(decay_steps),
        decay_style=args.lr_decay_style,
        wsd_decay_steps=args.lr_wsd_decay_iters,
        wsd_decay_style=args.lr_wsd_decay_style,
        use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
        override_lr_scheduler=args.override_lr_scheduler,
    )


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale the gradients so their total `norm_type` norm is at most `max_norm` (`--clip-grad`); returns the
    norm before clipping. `max_norm <= 0` only measures. Parameters without a gradient are skipped; FSDP2
    (DTensor) gradients give the global norm. A non-finite norm is returned as is (the caller skips the step)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    grads = [p.grad for p in with_grad]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    full = total.full_tensor() if hasattr(total, "full_tensor") else total
    return float(full)
