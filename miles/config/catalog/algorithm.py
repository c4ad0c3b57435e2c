"""Algorithm and loss: Flow-GRPO, DiffusionNFT, SFT, custom losses, advantages, reference/KL."""

from __future__ import annotations

from miles.config.catalog._common import DPO_JOBS, GUIDED_TRAIN_JOBS, NFT_JOBS, flag_maker
from miles.config.flags import BOOL, DOTTED, ENUM, FLOAT, INT, Flag
from miles.methods import LOSS_TYPES, UNCOND_GRAD_MODES  # the method table is the one list of loss types

GROUP = "Algorithm and loss"
_f = flag_maker(GROUP)


FLAGS: list[Flag] = [
    _f(
        "loss-type",
        ENUM,
        None,
        "Training objective. Default (auto): policy_loss for train rl, sft_loss for train sft, dmd2 for train dmd2.",
        choices=LOSS_TYPES,
        meta={"default_text": "auto"},
    ),
    _f(
        "advantage-estimator",
        ENUM,
        "grpo",
        "Advantage estimator: grpo (group mean and std), or gardo (GARDO's diversity-aware (r - mean) * m, no std).",
        choices=("grpo", "gardo"),
    ),
    _f(
        "disable-grpo-std-normalization",
        BOOL,
        False,
        "Do not divide advantages by the reward std (Dr.GRPO); always off with one sample per prompt.",
    ),
    _f(
        "globalize-reward-mean",
        BOOL,
        False,
        "Subtract the batch-wide reward mean instead of the per-prompt mean.",
    ),
    _f(
        "globalize-reward-std",
        BOOL,
        False,
        "Divide by the batch-wide reward std instead of the per-group std.",
    ),
    # The clip range must be positive; `min` is inclusive, so 0 itself is left to validation.
    _f("diffusion-clip-range", FLOAT, 1e-4, "PPO ratio clip range (positive).", min=0),
    _f(
        "diffusion-adv-clip-max",
        FLOAT,
        5.0,
        "Clamp on the absolute advantage; under nft it also scales the advantage-to-r mapping.",
        min=0,
    ),
    _f(
        "diffusion-recompute-old-log-prob",
        BOOL,
        False,
        "Recompute old log-probs with the trainer instead of using the engine's; policy_loss only.",
    ),
    _f(
        "diffusion-grpo-guard",
        BOOL,
        False,
        "GRPO-Guard: normalise each trained step's log-ratio (RatioNorm) and weight its loss by 1/|dt|; Flow-SDE "
        "rollouts only; the normalised ratio is s times smaller, so use a smaller --diffusion-clip-range (peers: "
        "2e-6 to 4e-6); policy_loss only.",
        jobs=NFT_JOBS,
    ),
    _f(
        "diffusion-cfg-uncond-grad",
        ENUM,
        "full",
        "The trained CFG forward's unconditional branch: full backpropagates through both branches (one batched "
        "forward where the family batches CFG); detach runs it as its own forward without grad, so the gradient "
        "flows through the conditional branch only (flow_grpo's detached uncond), for less compute (tiny-digits-grpo: "
        "0.65x the CPU of a step). The values are the same up to rounding; policy_loss and custom_loss only, with CFG "
        "in training.",
        choices=UNCOND_GRAD_MODES,
        jobs=GUIDED_TRAIN_JOBS,
    ),
    _f(
        "diffusion-kl-beta",
        FLOAT,
        0.0,
        "Coefficient of the KL penalty to the reference model; > 0 adds a reference forward.",
        min=0,
    ),
    _f(
        "ref-mode",
        ENUM,
        None,
        "Reference model: none, lora_base (the LoRA base, adapters off), ema (the EMA copy) or frozen (a frozen copy "
        "of the start weights). Default (auto): ema under nft; lora_base under dpo with --use-lora, else frozen; "
        "lora_base when --diffusion-kl-beta > 0; else none.",
        choices=("none", "lora_base", "ema", "frozen"),
        meta={"default_text": "auto"},
    ),
    _f(
        "custom-prepare-train-batch-path",
        DOTTED,
        None,
        "Function building the DiT inputs of a micro-batch.",
    ),
    _f(
        "custom-loss-function-path",
        DOTTED,
        None,
        "Loss formula for --loss-type custom_loss; the DiT forward stays in the trainer.",
    ),
    _f(
        "diffusion-nft-beta",
        FLOAT,
        1.0,
        "NFT: strength of the implicit positive/negative policy shift.",
        min=0,
        jobs=NFT_JOBS,
    ),
    _f(
        "diffusion-nft-timestep-fraction",
        FLOAT,
        0.99,
        "NFT: fraction of the timestep range that training timesteps are drawn from.",
        min=0,
        max=1,
        jobs=NFT_JOBS,
    ),
    _f(
        "no-diffusion-nft-adaptive-weight",
        BOOL,
        False,
        "NFT: turn off the adaptive per-sample loss weighting.",
        jobs=NFT_JOBS,
    ),
    _f(
        "no-diffusion-nft-shuffle-timesteps",
        BOOL,
        False,
        "NFT: turn off shuffling of the training timesteps.",
        jobs=NFT_JOBS,
    ),
    _f(
        "diffusion-dpo-beta",
        FLOAT,
        100.0,
        "DPO: the loss's beta in -log sigmoid(-(beta/2) (Delta_w - Delta_l)) (flow_grpo's convention; diffusers' "
        "beta_dpo is beta/2); > 0; dpo only.",
        min=0,
        jobs=DPO_JOBS,
    ),
    _f(
        "diffusion-dpo-num-timesteps",
        INT,
        1,
        "DPO: fresh (noise, sigma) draws per pair per optimizer step, each one train pair; dpo only.",
        min=1,
        jobs=DPO_JOBS,
    ),
]
