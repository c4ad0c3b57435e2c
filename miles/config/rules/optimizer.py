"""Optimizer and LR-schedule rules: the flag combinations the scheduler cannot honour, refused at parse time
(the trainer would otherwise stop on them only once its ranks have started)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.resolution import Resolution

if TYPE_CHECKING:
    from miles.config.jobs import JobSpec


def check_lr_schedule(res: Resolution, job: JobSpec) -> None:
    if res["override_lr_scheduler"] and res["use_checkpoint_lr_scheduler"]:
        if res.explicit("use_checkpoint_lr_scheduler"):
            res.fail(
                f"{res.show('override_lr_scheduler')} and {res.show('use_checkpoint_lr_scheduler')} are both on: "
                "on resume the schedule comes from the command line or from the checkpoint; pick one"
            )
        res.derive("use_checkpoint_lr_scheduler", False)  # overriding means not taking the checkpoint's
    if res["lr_warmup_fraction"] is not None and int(res["lr_warmup_iters"] or 0) > 0:
        res.fail(
            f"{res.show('lr_warmup_fraction')} and {res.show('lr_warmup_iters')} both set the warmup length; use one"
        )
    if res["lr_decay_style"] == "WSD" and res["lr_wsd_decay_iters"] is None:
        res.fail(f"{res.show('lr_decay_style')} needs --lr-wsd-decay-iters (the length of the final decay)")


RULES = (check_lr_schedule,)
