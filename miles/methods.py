"""The training methods: one table keyed by the `--loss-type` value users type, as `miles.models.families` is for
model families. Torch-free (the config layer reads it before torch is loaded).

Every reader of a loss type goes through it: the flag's choices (`miles.config.catalog.algorithm`), the jobs the
NFT and DPO flags are for (`miles.config.catalog._common`), each job's allowed and auto loss types and the automatic
`--ref-mode` (`miles.config.jobs`), the rule on which methods train on rollout pairs (`miles.config.rules.algorithm`),
each method's own rules and flags (`miles.config.rules.methods`), DMD2's critic group (`miles.config.trainer_config`),
the trainer's method object (`miles.training.methods`, loaded from `impl`), and the memory plan (`miles.memory.step`,
`miles.memory.static`). A new method is one entry here plus its module under `miles/training/methods/`, its flags
and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One `--loss-type`.

    jobs: the jobs whose `--loss-type` accepts it (`dmd2_critic` is set by `train dmd2` for its critic group only).
    auto_for: the jobs where it is the default.
    impl: its implementation, `module:Class` (a `miles.training.methods.base.TrainMethod`), built by the trainer.
    on_rollouts: it trains on rollout samples and their train pairs (so the pair hooks apply to it).
    guided_forward: the trained forward runs the rollout's guided velocity (CFG pairs when the rollout used CFG).
    ref_mode: the automatic `--ref-mode` it wants (None: `lora_base` when `--diffusion-kl-beta` > 0, else `none`).
    ref_mode_lora: the automatic `--ref-mode` under `--use-lora` where it differs from `ref_mode`.
    rules: the name of its rule function in `miles.config.rules.methods` (None: none of its own).
    own_flags: flags (dests) that only it reads: refused under any other method.
    critic: the loss type of a second trainer group the method trains against (DMD2's fake score), or None.
    frozen_teacher: its trainer also holds a frozen copy of its start point (without LoRA; the memory plan counts it).
    renoises_samples: it re-noises the rollout's clean latents at fresh noise levels (a family whose rollout steps
        part of its latent by ODE, like LTX-2's audio, cannot train it).
    forward_rows: DiT rows per train pair in its trained forward (DPO's pair is a winner and a loser: 2); the memory
        plan traces `--micro-batch-size` times this.
    sft_rows: what its `train sft` rows hold: `image` (an image or video with its caption) or `preference` (a
        caption with a chosen and a rejected image); the preflight and the SFT data reader read it.
    """

    name: str
    summary: str
    jobs: tuple[str, ...]
    impl: str
    auto_for: tuple[str, ...] = ()
    on_rollouts: bool = False
    guided_forward: bool = False
    ref_mode: str | None = None
    ref_mode_lora: str | None = None
    rules: str | None = None
    own_flags: tuple[str, ...] = ()
    critic: str | None = None
    frozen_teacher: bool = False
    renoises_samples: bool = False
    forward_rows: int = 1
    sft_rows: str = "image"

    def auto_ref_mode(self, use_lora: bool) -> str | None:
        """The `--ref-mode` it wants (None: the generic choice of `miles.config.jobs`)."""
        return self.ref_mode_lora if use_lora and self.ref_mode_lora is not None else self.ref_mode


_IMPL = "miles.training.methods."

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "policy_loss",
            "Flow-GRPO: the clipped policy-gradient ratio of SDE transitions, with an optional KL to a reference",
            jobs=("rl", "replay"),
            impl=_IMPL + "flow_grpo:FlowGrpo",
            auto_for=("rl", "replay"),
            on_rollouts=True,
            guided_forward=True,
            rules="check_policy_loss",
            own_flags=("diffusion_recompute_old_log_prob", "diffusion_grpo_guard"),
        ),
        Method(
            "nft",
            "DiffusionNFT: forward-process fine-tuning of the velocity on positive and negative samples",
            jobs=("rl", "replay"),
            impl=_IMPL + "nft:Nft",
            on_rollouts=True,
            ref_mode="ema",
            rules="check_nft",
            renoises_samples=True,
        ),
        Method(
            "sft_loss",
            "flow matching on dataset images",
            jobs=("sft",),
            impl=_IMPL + "sft:SftLoss",
            auto_for=("sft",),
        ),
        Method(
            "custom_loss",
            "your loss formula (--custom-loss-function-path) on miles' forward",
            jobs=("rl", "sft", "replay"),
            impl=_IMPL + "custom:CustomLoss",
            on_rollouts=True,
            guided_forward=True,
            rules="check_custom_loss",
            own_flags=("custom_loss_function_path", "custom_prepare_train_batch_path"),
        ),
        Method(
            "dpo",
            "Diffusion-DPO: the best against the worst sample of each group (online) or preference rows (offline)",
            jobs=("rl", "replay", "sft"),
            impl=_IMPL + "dpo:Dpo",
            on_rollouts=True,
            ref_mode="frozen",
            ref_mode_lora="lora_base",
            rules="check_dpo",
            own_flags=("diffusion_dpo_beta", "diffusion_dpo_num_timesteps", "chosen_key", "rejected_key"),
            renoises_samples=True,
            forward_rows=2,
            sft_rows="preference",
        ),
        Method(
            "dmd2",
            "DMD2's few-step student (distribution matching, optional GAN)",
            jobs=("dmd2",),
            impl=_IMPL + "dmd2:Dmd2Generator",
            auto_for=("dmd2",),
            critic="dmd2_critic",
            renoises_samples=True,
        ),
        Method(
            "dmd2_critic",
            "DMD2's critic: denoising score matching of the student's samples",
            jobs=(),
            impl=_IMPL + "dmd2:Dmd2Critic",
            frozen_teacher=True,
        ),
    )
}
LOSS_TYPES: tuple[str, ...] = tuple(METHODS)

# `--diffusion-cfg-uncond-grad`: how a `guided_forward` method's trained CFG forward treats the unconditional branch
# (`TrainPipelineConfig.guided_velocity`): `full` backpropagates through both branches, `detach` runs it without grad
UNCOND_GRAD_MODES: tuple[str, ...] = ("full", "detach")


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
