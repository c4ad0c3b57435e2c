"""The rollout manager's requests under Flow-GRPO-Fast's shared prefix and MixGRPO's window, and the denoiser
calls a rollout counts (tiny-sd3 in process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles.rollout.manager import RolloutManager, build_requests
from miles.sampling.step_strategies import resolve_step_strategy

CLI = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 8,
    "rollout_microgroup_size": 4,
    "global_batch_size": 16,
    "micro_batch_size": 16,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,5",
}
MIX = "miles.sampling.step_strategies.mix_grpo_window"


def job(checkpoint: str = "tiny-sd3", **cli):
    return resolve("rl", recipe="tiny-digits-grpo", cli={**CLI, "hf_checkpoint": checkpoint, **cli}).args


def groups_of(args, n_groups: int = 2):
    from miles.core.sample import Sample
    from miles.sampling.seeds import group_sample_seeds

    out = []
    for g in range(n_groups):
        seeds = group_sample_seeds(int(args.rollout_seed), g, 8, 4)
        out.append([Sample(index=g * 8 + j, group_index=g, prompt="p", seed=s) for j, s in enumerate(seeds)])
    return out


def test_a_shared_prefix_draws_the_steps_once_per_microgroup() -> None:
    per_sample = job()
    shared = job(diffusion_shared_prefix=True)
    plain = build_requests(per_sample, groups_of(per_sample), resolve_step_strategy(per_sample))
    branched = build_requests(shared, groups_of(shared), resolve_step_strategy(shared))
    assert len(branched) == 4 and all(r.shared_prefix for r in branched) and not any(r.shared_prefix for r in plain)
    for req in branched:  # one window per microgroup: its first sample's draw
        assert all(steps == req.sde_steps[0] for steps in req.sde_steps)
        assert req.sde_steps[0] == plain[branched.index(req)].sde_steps[0]
    assert any(len({tuple(s) for s in r.sde_steps}) > 1 for r in plain)  # per sample, they differ
    assert len({tuple(r.sde_steps[0]) for r in branched}) > 1  # and microgroups branch at different steps
    evaluation = build_requests(shared, groups_of(shared), resolve_step_strategy(shared), evaluation=True)
    assert not any(r.shared_prefix for r in evaluation)  # evaluation is plain ODE


def test_mix_grpo_requests_follow_the_rollout_id() -> None:
    args = job(diffusion_step_strategy_path=MIX, diffusion_sde_window_interval=2, diffusion_shared_prefix=True)
    windows = [
        build_requests(args, groups_of(args), resolve_step_strategy(args), rollout_id=k)[0].sde_steps[0]
        for k in range(0, 12, 2)
    ]
    assert windows == [[0, 1], [1, 2], [2, 3], [3, 4], [4], [0, 1]]  # range [0, 5), moved every 2 rollouts


@pytest.mark.slow
def test_flash_rollouts_count_fewer_denoiser_calls(tiny_sd3_dir: Path) -> None:
    """Same prompts and seeds: Flow-GRPO (every row every step), Fast (a shared prefix), MixGRPO-Flash (a shared
    prefix, DPM-Solver++ 2M on a compressed schedule after the window)."""
    variants = {
        "grpo": {},
        "fast": {"diffusion_shared_prefix": True},
        "flash": {
            "diffusion_step_strategy_path": MIX,
            "diffusion_shared_prefix": True,
            "diffusion_ode_solver": "dpmpp_2m",
            "diffusion_post_sde_steps_ratio": 0.4,
        },
    }
    calls = {}
    for name, cli in variants.items():
        manager = RolloutManager(job(str(tiny_sd3_dir), **cli))
        batch = manager.generate(0)
        calls[name] = batch.metrics["rollout/denoiser_calls"]
        assert batch.metrics["rollout/num_samples"] == 16
        assert all(0.0 <= s.reward <= 1.0 for s in batch.samples)
    assert calls["grpo"] == 16 * 6
    # 4 microgroups of 4: prefix r once, then 4 rows for 6 - r steps
    assert calls["grpo"] > calls["fast"] >= 4 * (4 * 6 - 3 * 3)
    # MixGRPO at rollout 0: window [0, 1], then max(int(5 * 0.4), 2) = 2 points, 1 step: 3 steps of 4 rows
    assert calls["flash"] == 4 * 4 * 3
