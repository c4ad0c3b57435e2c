"""The rollout manager in-process: microgroup requests, seeds, rewards, advantages, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.config.resolve import resolve
from miles.rollout.manager import RolloutManager, build_requests

pytestmark = pytest.mark.slow

CLI = {
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 2,
    "global_batch_size": 8,
    "diffusion_num_steps": 4,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,4",
}


@pytest.fixture(scope="module")
def manager(tiny_sd3_dir: Path) -> RolloutManager:
    args = resolve("rl", recipe="tiny-digits-grpo", cli={**CLI, "hf_checkpoint": str(tiny_sd3_dir)}).args
    return RolloutManager(args)


def test_requests_are_microgroups_of_one_prompt(manager: RolloutManager) -> None:
    groups = manager.data_source.get_samples(2)
    requests = build_requests(manager.args, groups, manager.strategy)
    assert len(requests) == 4  # 2 prompts x 4 samples / microgroups of 2
    for request in requests:
        assert len(request.seeds) == 2
        assert request.seeds[1] == request.seeds[0] + 1
        assert all(len(steps) == 2 and steps[1] == steps[0] + 1 for steps in request.sde_steps)
    assert requests[0].prompt == requests[1].prompt and requests[0].group_index == requests[1].group_index


def test_generate_returns_a_scored_batch(manager: RolloutManager) -> None:
    batch = manager.generate(0)
    samples = batch.samples
    assert len(samples) == 8
    assert [s.index for s in samples] == list(range(8))
    for g in range(2):
        group = samples[4 * g : 4 * g + 4]
        assert len({s.prompt for s in group}) == 1 and len({s.group_index for s in group}) == 1
        assert abs(sum(s.advantage for s in group)) < 1e-9
        label = group[0].metadata["label"]
        assert group[0].prompt.endswith(str(label))
    assert len({s.seed for s in samples}) == 8
    for s in samples:
        assert 0.0 <= s.reward <= 1.0
        assert s.trajectory.log_probs.shape == (2,)
        assert s.image.shape == (3, 64, 64)
    raw = [s.reward for s in samples]
    assert batch.metrics["rollout/reward/raw_mean"] == pytest.approx(sum(raw) / len(raw))
    assert batch.metrics["perf/rollout_time"] > 0
    nxt = manager.generate(1)
    assert not {s.seed for s in samples} & {s.seed for s in nxt.samples}
    assert min(s.group_index for s in nxt.samples) > max(s.group_index for s in samples)
