"""The training methods: one table keyed by the `--loss-type` value users type, as `miles.models.families` is for
model families. Torch-free (the config layer reads it before torch is loaded).

Every reader of a loss type goes through it: the flag's choices (`miles.config.catalog.algorithm`), each job's
allowed and auto loss types and the automatic `--ref-mode` (`miles.config.jobs`), the rule on which methods train on
rollout pairs (`miles.config.rules.algorithm`), the trainer's dispatch of a window to its pairs and micro-step
(`miles.training.trainer`), and the memory plan's traced step (`miles.memory.step`). A new method is one entry here
plus its implementation, flags and tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One `--loss-type`.

    jobs: the jobs whose `--loss-type` accepts it (`dmd2_critic` is set by `train dmd2` for its critic group only).
    auto_for: the jobs where it is the default.
    on_rollouts: it trains on rollout samples and their train pairs (so the pair hooks apply to it).
    pairs / step: the trainer's expansion of a window into pairs and its micro-step ("flow_grpo", "nft", "custom";
        None: the method trains through its own entry point, e.g. SFT's `train_sft`, DMD2's trainers).
    guided_forward: the trained forward runs the rollout's guided velocity (CFG pairs when the rollout used CFG).
    ref_mode: the automatic `--ref-mode` it wants (None: `lora_base` when `--diffusion-kl-beta` > 0, else `none`).
    rules: its rule function in `miles.config.rules.methods.RULES_BY_NAME` (None: none of its own).
    own_flags: flags (dests) that only it reads: refused under any other method.
    """

    name: str
    summary: str
    jobs: tuple[str, ...]
    auto_for: tuple[str, ...] = ()
    on_rollouts: bool = False
    pairs: str | None = None
    step: str | None = None
    guided_forward: bool = False
    ref_mode: str | None = None
    rules: str | None = None
    own_flags: tuple[str, ...] = ()


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "policy_loss",
            "Flow-GRPO: the clipped policy-gradient ratio of SDE transitions, with an optional KL to a reference",
            jobs=("rl", "replay"),
            auto_for=("rl", "replay"),
            on_rollouts=True,
            pairs="flow_grpo",
            step="flow_grpo",
            guided_forward=True,
            rules="policy_loss",
            own_flags=("diffusion_recompute_old_log_prob",),
        ),
        Method(
            "nft",
            "DiffusionNFT: forward-process fine-tuning of the velocity on positive and negative samples",
            jobs=("rl", "replay"),
            on_rollouts=True,
            pairs="nft",
            step="nft",
            ref_mode="ema",
            rules="nft",
        ),
        Method("sft_loss", "flow matching on dataset images", jobs=("sft",), auto_for=("sft",)),
        Method(
            "custom_loss",
            "your loss formula (--custom-loss-function-path) on miles' forward",
            jobs=("rl", "sft", "replay"),
            on_rollouts=True,
            pairs="flow_grpo",
            step="custom",
            guided_forward=True,
            rules="custom_loss",
            own_flags=("custom_loss_function_path", "custom_prepare_train_batch_path"),
        ),
        Method(
            "dmd2", "DMD2's few-step student (distribution matching, optional GAN)", jobs=("dmd2",), auto_for=("dmd2",)
        ),
        Method("dmd2_critic", "DMD2's critic: denoising score matching of the student's samples", jobs=()),
    )
}
LOSS_TYPES: tuple[str, ...] = tuple(METHODS)


def method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"--loss-type {name!r}: no such method (have {', '.join(LOSS_TYPES)})") from None


def loss_types_for(job: str) -> tuple[str, ...]:
    """The `--loss-type` values `job` accepts, in table order."""
    return tuple(m.name for m in METHODS.values() if job in m.jobs)


def auto_loss_type(job: str) -> str | None:
    return next((m.name for m in METHODS.values() if job in m.auto_for), None)


def rollout_loss_types() -> tuple[str, ...]:
    return tuple(m.name for m in METHODS.values() if m.on_rollouts)
