"""Training losses keyed by the `--loss-type` names users type; pure tensor math (no Ray, no diffusers).

Every loss takes predictions the trainer already computed and returns `(loss: Tensor, metrics: dict[str, float])`:

    policy_loss   Flow-GRPO clipped ratio loss + optional reference KL   (miles.algorithms.policy_loss)
    nft           DiffusionNFT implicit positive/negative regression      (miles.algorithms.nft)
    sft_loss      flow matching `mean((v - (noise - x0))**2)`             (miles.algorithms.sft_loss)
    dmd2          DMD2 distribution-matching generator loss               (miles.algorithms.dmd2)
    dmd2_critic   DMD2 critic (fake score) flow-matching loss             (miles.algorithms.dmd2)

`custom_loss` is not registered here: its formula comes from `--custom-loss-function-path`.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.algorithms.dmd2 import dmd2_critic_loss, dmd2_generator_loss
from miles.algorithms.nft import nft_loss
from miles.algorithms.policy_loss import policy_loss
from miles.algorithms.sft_loss import sft_loss

LossFn = Callable[..., tuple]

LOSSES: dict[str, LossFn] = {
    "policy_loss": policy_loss,
    "nft": nft_loss,
    "sft_loss": sft_loss,
    "dmd2": dmd2_generator_loss,
    "dmd2_critic": dmd2_critic_loss,
}

LOSS_NAMES: tuple[str, ...] = tuple(LOSSES)

__all__ = [
    "LOSSES",
    "LOSS_NAMES",
    "dmd2_critic_loss",
    "dmd2_generator_loss",
    "get_loss",
    "nft_loss",
    "policy_loss",
    "sft_loss",
]


def get_loss(name: str) -> LossFn:
    """The loss function registered under the `--loss-type` value `name`.

    Raises ValueError for an unknown name (listing the registered ones), and for `custom_loss`, whose
    formula is loaded from `--custom-loss-function-path` rather than from this registry.
    """
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        pass
    if name == "custom_loss":
        raise ValueError(
            "--loss-type custom_loss has no built-in formula: load it from --custom-loss-function-path"
        ) from None
    raise ValueError(f"unknown --loss-type {name!r}; choose one of: {', '.join(LOSS_NAMES)}") from None
