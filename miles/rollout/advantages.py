"""Rewards to advantages: GRPO group normalization (and the flow_grpo per-prompt tracker, for parity checks).

GRPO, as the reference `_post_process_rewards` computes it (samples in group order, groups contiguous):

    R    = rewards.reshape(-1, n)                       n = --n-samples-per-prompt
    A    = R - (R.mean() if --globalize-reward-mean else R.mean(dim=-1))
    if std normalization (on unless --disable-grpo-std-normalization, and always off when n == 1):
        A /= (R.std() if --globalize-reward-std else R.std(dim=-1)) + 1e-4      # torch unbiased std

GARDO's diversity-aware advantage (`--advantage-estimator gardo`, algorithms_next.md E.2 item 1), per prompt group::

    d_ij = 1 - clip(f_i . f_j, -1, 1)                   f = the L2-normalised features of each output
    delta_i = min_{j != i} d_ij                          the distance to the nearest group mate
    m_i = 1 if r_i < mean(r) else delta_i / mean_j(delta_j)
    A_i = (r_i - mean(r)) * m_i                          no division by a std

so a good sample unlike its group mates is pushed harder and a near-duplicate of another good one less. GARDO takes
its features from DINOv3; here they are the outputs average-pooled to at most 64 x 64 (`miles.rollout.diversity`),
since no feature network's weights may be downloaded (a user's features: `--custom-reward-post-process-path`). The
group std flags do not apply to it (refused with it).

Several rewards (`--rm-type a,b`, `--reward-weights`), by `--reward-component-norm`:

    none   A = estimator(sum_k w_k r_k)                              the weighted sum of raw scores (flow_grpo)
    group  A = sum_k w_k estimator(r_k)                              each reward's own group advantage, then
                                                                     weighted (MixGRPO's advantage_aggr, GDPO)
    batch  A = estimator(sum_k w_k (r_k - mean(r_k)) / (std(r_k) + 1e-4))   each reward z-scored over the rollout

`none` is the default because it is what the references train with and it keeps a weight's meaning (a unit of
reward is worth w); `group` and `batch` keep a reward with a wide range (JPEG size in kB) from drowning one in
[0, 1], at the cost of weighting a component's noise as much as its signal when its spread is tiny.

Samples flagged `remove_sample` still count: the filter masks the loss, not the statistics.
`--custom-reward-post-process-path` replaces all of this with `post_process(args, samples) -> (raw, normalized)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles.core.sample import Sample
from miles.utils.hooks import load_function

STD_EPS = 1e-4  # "+1e-4 matches flow_grpo"


def grpo_advantages(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    *,
    globalize_mean: bool = False,
    globalize_std: bool = False,
    std_normalization: bool = True,
) -> torch.Tensor:
    """GRPO advantages of a flat `[N]` reward tensor whose groups of `n_samples_per_prompt` are contiguous."""
    n = int(n_samples_per_prompt)
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor, got shape {tuple(rewards.shape)}")
    if rewards.numel() % n != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of n_samples_per_prompt={n}; "
            "every prompt group must be complete"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if rewards.numel() == 0:
        return rewards.clone()
    grouped = rewards.reshape(-1, n)
    mean = grouped.mean() if globalize_mean else grouped.mean(dim=-1, keepdim=True)
    advantages = grouped - mean
    if std_normalization and n > 1:
        std = grouped.std() if globalize_std else grouped.std(dim=-1, keepdim=True)
        advantages = advantages / (std + STD_EPS)
    return advantages.reshape(-1)


def gardo_advantages(rewards: torch.Tensor, features: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """GARDO's diversity-aware advantages of flat `[N]` rewards with `[N, D]` features, groups of `n` contiguous."""
    n = int(n_samples_per_prompt)
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.dim() != 1 or rewards.numel() % n != 0 or features.shape[0] != rewards.numel():
        raise ValueError(
            f"{rewards.numel()} rewards and {features.shape[0]} feature rows must split into groups of {n}"
        )
    f = torch.nn.functional.normalize(features.to(torch.float64).reshape(rewards.numel(), -1), dim=1)
    out = torch.zeros_like(rewards)
    for start in range(0, rewards.numel(), n):
        r, g = rewards[start : start + n], f[start : start + n]
        centred = r - r.mean()
        if n == 1:
            continue
        dist = 1 - (g @ g.T).clamp(-1, 1)
        dist.fill_diagonal_(float("inf"))
        delta = dist.min(dim=1).values
        scale = delta / delta.mean() if float(delta.mean()) > 0 else torch.ones_like(delta)
        out[start : start + n] = centred * torch.where(r < r.mean(), torch.ones_like(scale), scale)
    return out


def per_prompt_advantages(
    prompts: Sequence[str], rewards: Sequence[float], *, global_std: bool = False
) -> torch.Tensor:
    """flow_grpo's `PerPromptStatTracker` (one epoch, no history): groups by prompt string, population std.

    A_i = (r_i - mean over samples with prompt_i) / (std + 1e-4), with std the population std of the
    whole batch (`global_std=True`) or of the prompt's rewards. Kept for parity checks against flow_grpo.
    """
    values = torch.as_tensor(list(rewards), dtype=torch.float64)
    if len(prompts) != values.numel():
        raise ValueError(f"{len(prompts)} prompts but {values.numel()} rewards")
    out = torch.zeros_like(values)
    batch_std = values.std(correction=0) if values.numel() else values.new_tensor(0.0)
    for prompt in dict.fromkeys(prompts):
        mask = torch.tensor([p == prompt for p in prompts])
        group = values[mask]
        std = batch_std if global_std else group.std(correction=0)
        out[mask] = (group - group.mean()) / (std + STD_EPS)
    return out


def post_process_rewards(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Compute every sample's advantage (sets `sample.advantage`); returns `(raw_rewards, advantages)`.

    The samples must be in group order (each run of `n_samples_per_prompt` shares one `group_index`).
    """
    hook_path = args.custom_reward_post_process_path
    if hook_path:
        hook = load_function(hook_path, "--custom-reward-post-process-path")
        result = hook(args, samples)
        try:
            raw, normalized = result
            raw, normalized = [float(r) for r in raw], [float(a) for a in normalized]
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"--custom-reward-post-process-path {hook_path!r} must return (raw_rewards, normalized_rewards), "
                f"two lists of numbers ({exc})"
            ) from None
        if len(raw) != len(samples) or len(normalized) != len(samples):
            raise ValueError(
                f"--custom-reward-post-process-path {hook_path!r} returned {len(raw)} raw and {len(normalized)} "
                f"normalized rewards for {len(samples)} samples"
            )
    else:
        n = int(args.n_samples_per_prompt or 1)
        _check_groups(samples, n)
        reward_key = args.reward_key
        raw = [sample.scalar_reward(reward_key) for sample in samples]
        estimator = ESTIMATORS[args.advantage_estimator]
        norm = getattr(args, "reward_component_norm", None) or "none"
        if norm == "none" or not any(s.reward_components for s in samples):
            normalized = estimator(args, samples, raw, n)
        else:
            normalized = _by_component(args, samples, n, norm, estimator)
    for sample, advantage in zip(samples, normalized, strict=True):
        sample.advantage = float(advantage)
    return raw, normalized


def _components(args: Any, samples: Sequence[Sample]) -> dict[str, tuple[float, list[float]]]:
    """{reward type: (weight, [each sample's raw score])}; every sample must carry every component."""
    from miles.rewards import reward_components

    out: dict[str, tuple[float, list[float]]] = {}
    for name, weight in reward_components(args):
        values = []
        for sample in samples:
            comps = sample.reward_components or {}
            if name not in comps:
                raise ValueError(
                    f"sample {sample.index} has no {name!r} score (its metadata.rm_type replaces the job's rewards); "
                    "--reward-component-norm needs every reward on every sample"
                )
            values.append(float(comps[name]))
        out[name] = (weight, values)
    return out


def _by_component(args: Any, samples: list[Sample], n: int, norm: str, estimator: Any) -> list[float]:
    """The advantages of a multi-reward rollout under `--reward-component-norm group|batch` (module docstring)."""
    components = _components(args, samples)
    if norm == "group":
        total = torch.zeros(len(samples), dtype=torch.float64)
        for weight, values in components.values():
            total += weight * torch.tensor(estimator(args, samples, values, n), dtype=torch.float64)
        return total.tolist()
    combined = torch.zeros(len(samples), dtype=torch.float64)
    for weight, values in components.values():
        r = torch.tensor(values, dtype=torch.float64)
        std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        combined += weight * (r - r.mean()) / (std + STD_EPS)
    return estimator(args, samples, combined.tolist(), n)


def _check_groups(samples: Sequence[Sample], n: int) -> None:
    if len(samples) % n != 0:
        raise ValueError(
            f"{len(samples)} samples do not split into groups of n_samples_per_prompt={n}; "
            "every prompt group must be complete"
        )
    for start in range(0, len(samples), n):
        group = {sample.group_index for sample in samples[start : start + n]}
        if len(group) != 1:
            raise ValueError(
                f"samples {start}..{start + n - 1} should form one prompt group but have group_index "
                f"{sorted(group)}; keep each group's samples contiguous"
            )


def _grpo(args: Any, samples: list[Sample], raw: list[float], n: int) -> list[float]:
    return grpo_advantages(
        torch.tensor(raw, dtype=torch.float64),
        n,
        globalize_mean=bool(args.globalize_reward_mean),
        globalize_std=bool(args.globalize_reward_std),
        std_normalization=not args.disable_grpo_std_normalization,
    ).tolist()


def _gardo(args: Any, samples: list[Sample], raw: list[float], n: int) -> list[float]:
    from miles.rollout.diversity import pooled

    if any(s.image is None for s in samples):
        raise ValueError("--advantage-estimator gardo compares the samples' outputs, and a sample has no image")
    features = torch.stack([pooled(s.image) for s in samples])
    return gardo_advantages(torch.tensor(raw, dtype=torch.float64), features, n).tolist()


# --advantage-estimator: the estimators, keyed by the value users type
ESTIMATORS = {"grpo": _grpo, "gardo": _gardo}
