"""Engine flags on a real sglang-diffusion server (tiny-sd3, one engine, fp32, 64x64, 4 steps):

--diffusion-flow-shift        the server samples on the shifted schedule (`--flow-shift`), the one the
                              in-process engine computes; flux's dynamic-shift scheduler too (served view)
--use-distributed-post        the rollout's POSTs leave from the per-node poster actors
                              ($MILES_HTTP_POST_ACTORS_PER_NODE = 2), and the samples are the local client's
--update-weight-buffer-size   a full sync is written and loaded in shards of at most that many bytes, every
                              tensor verified on the server
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.sglang.posting import DistributedPoster, LocalPoster
from miles.rollout.engines.sglang.protocol import server_requests
from miles.rollout.manager import RolloutManager, build_requests
from miles.utils.sglang_env import ACTORS_PER_NODE_VAR

SHIFT = 3.0
STEPS = 4
CLI: dict[str, Any] = {
    "rollout_backend": "sglang",
    "rollout_num_engines": 1,
    "rollout_batch_size": 2,
    "n_samples_per_prompt": 2,
    "rollout_microgroup_size": 2,
    "global_batch_size": 4,
    "micro_batch_size": 4,
    "diffusion_num_steps": STEPS,
    "diffusion_num_sde_steps": 2,
    "diffusion_sde_window_range": "0,3",
    "diffusion_flow_shift": SHIFT,
}


def _manager(recipe: str, checkpoint: Path, out: Path, **cli: Any) -> RolloutManager:
    args = resolve("rl", recipe=recipe, cli={**CLI, **cli, "hf_checkpoint": str(checkpoint), "output_dir": str(out)})
    return RolloutManager(args.args, use_ray_engines=True)


@pytest.fixture(scope="module")
def sd3(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory, local_ray: Any):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ACTORS_PER_NODE_VAR, "2")
        out = tmp_path_factory.mktemp("flags")
        manager = _manager("tiny-digits-grpo", tiny_sd3_dir, out, use_distributed_post=True)
    try:
        yield manager
    finally:
        manager.shutdown()


def _requests(manager: RolloutManager, groups: int = 1) -> list[Any]:
    return build_requests(manager.args, manager.data_source.get_samples(groups), manager.strategy)


def _schedule(checkpoint: Path, family: Any, flow_shift: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    import diffusers

    config = json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text())
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    return family.schedule(scheduler, STEPS, (1, 16, 8, 8), flow_shift)


def _assert_shifted(samples: list[Any], checkpoint: Path, family: Any) -> None:
    sigmas, timesteps = _schedule(checkpoint, family, SHIFT)
    unshifted, _ = _schedule(checkpoint, family, None)
    assert (sigmas - unshifted).abs().max() > 0.05
    for s in samples:
        torch.testing.assert_close(s.trajectory.sigmas, sigmas, rtol=0, atol=1e-6)
        torch.testing.assert_close(s.trajectory.timesteps, timesteps, rtol=0, atol=1e-3)


def test_the_server_samples_on_the_shifted_schedule(sd3: RolloutManager, tiny_sd3_dir: Path) -> None:
    log = Path(sd3.engine_info()[0]["log"]).read_text().splitlines()
    command = [line for line in log if line.startswith("$ ")][-1].split()
    assert command[command.index("--flow-shift") + 1] == str(SHIFT)
    samples = sd3.run_requests(_requests(sd3))
    assert len(samples) == 2
    _assert_shifted(samples, tiny_sd3_dir, sd3.sglang.family)


def test_posts_leave_from_the_poster_actors_and_match_the_local_client(sd3: RolloutManager) -> None:
    import os

    poster = sd3.sglang.poster
    assert isinstance(poster, DistributedPoster)
    before = poster.info()
    assert len(before) == 2 and os.getpid() not in {i["pid"] for i in before}
    requests = _requests(sd3, 2)
    posts = sum(len(server_requests(r)) for r in requests)  # a microgroup whose samples differ in SDE steps splits
    assert posts >= 2
    remote = sd3.run_requests(copy.deepcopy(requests))
    after = poster.info()
    sent = [a["posts"] - b["posts"] for a, b in zip(after, before, strict=True)]
    assert sum(sent) == posts and max(sent) - min(sent) <= 1  # every POST, dealt round-robin
    sd3.sglang.poster = LocalPoster()
    try:
        local = sd3.run_requests(copy.deepcopy(requests))
    finally:
        sd3.sglang.poster = poster
    assert poster.info() == after  # the local client sent those
    assert [s.seed for s in remote] == [s.seed for s in local]
    for r, lo in zip(remote, local, strict=True):
        assert torch.equal(r.trajectory.latents, lo.trajectory.latents)
        assert torch.equal(r.trajectory.log_probs, lo.trajectory.log_probs)
        assert torch.equal(r.image, lo.image)


def test_a_full_sync_is_loaded_in_buffer_sized_shards(sd3: RolloutManager, tiny_sd3_pipeline: Any) -> None:
    state = {k: v.detach().clone() for k, v in tiny_sd3_pipeline.transformer.state_dict().items()}
    state["proj_out.bias"] += 0.05
    sd3.args.update_weight_buffer_size = 256 * 1024
    try:
        sd3.update_weights(state, 1)
    finally:
        sd3.args.update_weight_buffer_size = 512 * 1024 * 1024
    metrics = sd3.sync_metrics()
    assert metrics["sync/buckets"] == 6  # 1.19 MB of fp32 weights in shards of at most 256 KiB
    assert metrics["sync/verified_tensors"] == 66  # every parameter, bit for bit, on the server
    written = sd3.sglang.root / "weights" / "v1" / "transformer"
    assert len(list(written.glob("diffusion_pytorch_model-*-of-00006.safetensors"))) == 6


# extended: ~35 s (a second server); tests/rollout/test_sglang_flow_shift.py checks flux's served scheduler view
@pytest.mark.extended
def test_flux_dynamic_shift_is_replaced_on_the_server(tiny_flux_dir: Path, tmp_path: Path, local_ray: Any) -> None:
    manager = _manager("tiny-flux-digits-grpo", tiny_flux_dir, tmp_path, diffusion_true_cfg_scale=1.0)
    try:
        samples = manager.run_requests(_requests(manager))
        _assert_shifted(samples, tiny_flux_dir, manager.sglang.family)
    finally:
        manager.shutdown()
