"""`--loss-type dpo` on a real tiny-sd3 trainer (one gloo rank): online on the session rollout's groups (reference:
the frozen copy of the start weights), offline on a preference set built from the digits (reference: the LoRA
base); plus the window padding that keeps several dp ranks in step (fast)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import free_port, trainer_args

from miles.algorithms.dpo import group_pair
from miles.config.resolve import resolve
from miles.core.sample import Sample
from miles.training.methods.dpo import even_for_ranks
from miles.training.pairs import Pair

# the tiny-digits-grpo flags dpo does not read (its GRPO advantage shaping), set back to their defaults
DPO = {"loss_type": "dpo", "globalize_reward_std": False}


def _sample(i: int) -> Sample:
    return Sample(index=i, group_index=i, prompt="p")


def test_padding_evens_the_ranks_shares_and_keeps_the_mean_exact() -> None:
    pairs = [Pair(_sample(i), 0, -1, 0.5, partner=_sample(10 + i)) for i in range(5)]
    assert even_for_ranks(pairs, 1) is pairs and even_for_ranks(pairs, 5) is pairs and even_for_ranks([], 4) == []
    padded = even_for_ranks(pairs, 4)
    assert len(padded) == 8  # every rank gets 2 pairs, so the same number of forwards
    assert [p.weight for p in padded] == [8 / 5] * 5 + [0.0] * 3
    assert [p.sample.index for p in padded] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert sum(p.weight for p in padded) / len(padded) == pytest.approx(1.0)  # the mean over the real pairs


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _rank_velocity(trainer, calls: list) -> None:
    """Record every DiT input (latents, timesteps, samples) of `trainer.velocity`, then run it."""
    forward = trainer.velocity

    def recording(x, timesteps, samples, cfg_scale):
        calls.append((x.detach().clone(), timesteps.detach().clone(), list(samples), cfg_scale))
        return forward(x, timesteps, samples, cfg_scale)

    trainer.velocity = recording


@pytest.mark.slow
def test_online_dpo_trains_a_step_from_ln2_with_shared_noise_and_sigma(tiny_sd3_dir: Path, rollout) -> None:
    from miles.training.model import full_state_dict
    from miles.training.trainer import Trainer

    _, batch = rollout
    args = trainer_args(tiny_sd3_dir, lr=1e-3, diffusion_dpo_num_timesteps=2, fsdp_flow_shift=3.0, **DPO)
    assert args.ref_mode == "frozen"  # the automatic reference of dpo without --use-lora
    trainer = Trainer(args, master_port=free_port())
    assert trainer.frozen_reference is not None
    start = full_state_dict(trainer.model)
    calls: list = []
    _rank_velocity(trainer, calls)

    metrics = trainer.train(0, batch.samples)

    groups: dict[int, list[float]] = {}
    for s in batch.samples:
        groups.setdefault(s.group_index, []).append(float(s.reward))
    expected = sum(group_pair(r) is not None for r in groups.values())
    assert expected >= 1 and metrics["pairs"] == expected  # one pair per group with distinct rewards
    assert metrics["tied_groups"] == len(groups) - expected
    assert trainer.global_step == 1 and metrics["grad_norm"] > 0
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)  # before the step the policy is the reference
    assert metrics["margin"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["e_theta_winner"] == pytest.approx(metrics["e_ref_winner"], abs=1e-7)

    # 2 draws per pair, micro-batches of 4 pairs: each micro-step runs the reference, then the trained forward
    assert len(calls) == 2 * math.ceil(2 * expected / 4)
    for (x_ref, t_ref, s_ref, cfg_ref), (x, t, s, cfg) in zip(calls[::2], calls[1::2], strict=True):
        assert torch.equal(x_ref, x) and torch.equal(t_ref, t) and cfg_ref is None and cfg is None  # unguided
        assert [id(a) for a in s_ref] == [id(b) for b in s]  # the reference saw the same pairs
        count = len(s) // 2
        winners, losers = s[:count], s[count:]
        assert all(w.group_index == lo.group_index for w, lo in zip(winners, losers, strict=True))
        assert torch.equal(t[:count], t[count:])  # one sigma per pair
        sigma = (t[:count] / 1000.0).reshape(-1, 1, 1, 1)
        x0_w = torch.stack([w.trajectory.latents[-1] for w in winners]).float()
        x0_l = torch.stack([lo.trajectory.latents[-1] for lo in losers]).float()
        noise_w = x[:count] - (1 - sigma) * x0_w  # = sigma * noise: one noise draw shared by winner and loser
        noise_l = x[count:] - (1 - sigma) * x0_l
        assert torch.allclose(noise_w, noise_l, atol=1e-5)
        assert float(noise_w.abs().mean()) > 0.01
        for w, lo in zip(winners, losers, strict=True):  # the group's best against its worst reward
            rewards = groups[w.group_index]
            assert float(w.reward) == max(rewards) and float(lo.reward) == min(rewards)

    after, frozen = full_state_dict(trainer.model), full_state_dict(trainer.frozen_reference)
    assert any(not torch.equal(after[n], start[n]) for n in start)  # the step moved the weights
    assert all(torch.equal(frozen[n], start[n]) for n in start)  # the reference did not move
    assert not any(p.requires_grad for p in trainer.frozen_reference.parameters())

    # --offload-train moves the frozen copy with the parameters, and brings it back bit for bit
    trainer.offload(("params",))
    assert all(_local(p).untyped_storage().nbytes() == 0 for p in trainer.frozen_reference.parameters())
    trainer.onload()
    assert all(torch.equal(full_state_dict(trainer.frozen_reference)[n], start[n]) for n in start)


@pytest.mark.slow
def test_offline_dpo_trains_a_step_on_the_digit_preference_set(tiny_sd3_dir: Path, tmp_path: Path) -> None:
    from miles.data.digit_preferences import write_digit_preference_data
    from miles.runtime.train_sft import encode_train_rows
    from miles.training.preference_data import PreferenceDataset
    from miles.training.trainer import Trainer

    files = write_digit_preference_data(tmp_path / "prefs", limit=8)
    cli = {"hf_checkpoint": str(tiny_sd3_dir), "prompt_data": str(files["train"]), "global_batch_size": 4}
    cli |= {"micro_batch_size": 4, "use_lora": True, "lora_rank": 4, "lora_alpha": 8, "lr": 1e-2}
    args = resolve("sft", recipe="tiny-digits-dpo-offline", cli=cli).args
    assert args.ref_mode == "lora_base"  # the automatic reference of dpo under --use-lora
    data = encode_train_rows(args)
    assert isinstance(data, PreferenceDataset) and len(data) == 8
    x0, samples = data.batch([0, 1, 2, 3], torch.Generator().manual_seed(0))
    assert x0.shape[:2] == (4, 2) and not torch.equal(x0[:, 0], x0[:, 1])  # chosen, rejected
    assert [s.prompt for s in samples] == data.prompts[:4]  # no caption dropout

    trainer = Trainer(args, master_port=free_port())
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.train_sft(x0, samples)
    assert metrics["pairs"] == 4 and metrics["grad_norm"] > 0
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)  # zero-initialised LoRA B: policy == base
    assert any(not torch.equal(p.detach(), adapters[n]) for n, p in trainer.model.named_parameters() if n in adapters)
    again = trainer.train_sft(x0, samples)
    assert again["loss"] != pytest.approx(math.log(2), abs=1e-6)  # the policy moved away from its reference

    # --diffusion-dpo-beta: at theta = ref the gradient is (beta / 4) (grad e_w - grad e_l), so doubling beta doubles
    # the gradient norm of the same draws (the same seed); 2 draws per pair double the pairs (each is a forward)
    double = resolve("sft", recipe="tiny-digits-dpo-offline", cli=cli | {"diffusion_dpo_beta": 200.0}).args
    assert double.diffusion_dpo_beta == 2 * args.diffusion_dpo_beta == 200.0 and args.diffusion_dpo_num_timesteps == 2
    scaled = Trainer(double, master_port=free_port()).train_sft(x0, samples)
    assert scaled["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert scaled["grad_norm"] == pytest.approx(2 * metrics["grad_norm"], rel=1e-4)
