"""`--loss-type sft_loss`: flow matching on dataset latents (`miles train sft`).

Its step is the trainer's dataset step with the default loss (`miles.training.flow_matching`): sigma from the
shifted logit-normal (`--fsdp-flow-shift`), fresh noise, `sft_loss` on the unguided velocity over the elements the
data carries. Every method keeps that step for dataset latents (the SFT start points of the built-in checkpoints are
trained by it); `custom_loss` replaces the loss with its hook.
"""

from __future__ import annotations

from miles.training.methods.base import TrainMethod


class SftLoss(TrainMethod):
    """The dataset step of `TrainMethod` as it is: flow matching with `sft_loss`."""
