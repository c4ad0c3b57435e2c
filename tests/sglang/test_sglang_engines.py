"""Two real sglang-diffusion engines behind the miles router, driven by the rollout manager.

One module-scoped manager (one Ray, two servers, ~30 s to start) serves every test, in order:
contract and parity, full-weight sync, fault tolerance (a killed server, a killed actor), LoRA sync, then the
failure without it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.engines.sglang.rollout import RolloutEngineError
from miles.rollout.manager import RolloutManager, build_requests
from miles.sampling.sde import sde_step

CLI: dict[str, Any] = {
    "rollout_backend": "sglang",
    "rollout_num_engines": 2,
    "use_fault_tolerance": True,
    "rollout_health_check_interval": 1.0,
    "rollout_health_check_timeout": 5.0,
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "rollout_microgroup_size": 4,
    "global_batch_size": 16,
    "micro_batch_size": 16,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 3,
    "diffusion_sde_window_range": "0,5",
}


@pytest.fixture(scope="module")
def manager(tiny_sd3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    import ray

    out = tmp_path_factory.mktemp("sglang_run")
    cli = {**CLI, "hf_checkpoint": str(tiny_sd3_dir), "output_dir": str(out)}
    args = resolve("rl", recipe="tiny-digits-grpo", cli=cli).args
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2
    )  # a new local Ray, never a cluster someone started
    try:
        mgr = RolloutManager(args, use_ray_engines=True)
        yield mgr
        mgr.shutdown()
    finally:
        ray.shutdown()


def _recompute_log_probs(transformer: Any, sample: Any) -> torch.Tensor:
    """The trainer's view: the diffusers transformer on the engine's latents and conditions."""
    traj, cond = sample.trajectory, sample.conditions
    out = []
    for i in traj.sde_step_indices:
        x = traj.latents[i : i + 1]
        enc = torch.stack([cond.negative["encoder_hidden_states"], cond.positive["encoder_hidden_states"]])
        pooled = torch.stack([cond.negative["pooled_projections"], cond.positive["pooled_projections"]])
        with torch.no_grad():
            v = transformer(
                hidden_states=torch.cat([x, x]),
                timestep=traj.timesteps[i].expand(2),
                encoder_hidden_states=enc,
                pooled_projections=pooled,
            ).sample
        v_neg, v_pos = v.chunk(2)
        v = v_neg + cond.guidance_scale * (v_pos - v_neg)
        res = sde_step(
            v,
            x,
            traj.sigmas[i],
            traj.sigmas[i + 1],
            sde_type=traj.sde_type,
            noise_level=traj.noise_level,
            sigma_max=traj.sigmas[1],
            prev_sample=traj.latents[i + 1 : i + 2],
        )
        out.append(res.log_prob[0])
    return torch.stack(out)


def _requests(manager: RolloutManager, n: int = 2) -> list[Any]:
    groups = manager.data_source.get_samples(n)
    return build_requests(manager.args, groups, manager.strategy)


def test_generate_returns_the_diffusers_sample_contract(manager: RolloutManager, tiny_sd3_pipeline) -> None:
    batch = manager.generate(0)
    samples = batch.samples
    assert len(samples) == 16 and [s.index for s in samples] == list(range(16))
    assert len({s.seed for s in samples}) == 16
    for s in samples:
        traj = s.trajectory
        assert traj.latents.shape == (7, 4, 8, 8) and traj.timesteps.shape == (6,) and traj.sigmas.shape == (7,)
        assert traj.sde_step_indices == sorted(traj.sde_step_indices) and len(traj.sde_step_indices) == 3
        assert traj.log_probs.shape == (3,) and torch.isfinite(traj.log_probs).all()
        assert s.conditions.positive["pooled_projections"].shape == (64,)
        assert s.conditions.negative["encoder_hidden_states"].shape[-1] == 64
        assert s.image.shape == (3, 64, 64) and 0.0 <= float(s.reward) <= 1.0
    # the image the reward saw is the one the final latent decodes to (VAE tiling off)
    latents = torch.stack([s.trajectory.latents[-1] for s in samples[:4]])
    with torch.no_grad():
        decoded = manager_family_decode(tiny_sd3_pipeline, latents)
    images = torch.stack([s.image for s in samples[:4]])
    assert (decoded - images).abs().max().item() < 1e-5
    # the router spread the requests (microgroups, split where samples run different SDE steps) evenly
    served = [stat["served"] for stat in manager.sglang.router.stats().values()]
    assert len(served) == 2 and min(served) >= 1 and abs(served[0] - served[1]) <= 1


def manager_family_decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    from miles.models.families import resolve_family

    return resolve_family("tiny-sd3").decode_latents(pipe, latents).float()


def test_engine_log_probs_equal_the_trainer_recompute(manager: RolloutManager, tiny_sd3_pipeline) -> None:
    samples = manager.run_requests(_requests(manager, 1))
    for s in samples:
        diff = (_recompute_log_probs(tiny_sd3_pipeline.transformer, s) - s.trajectory.log_probs).abs().max()
        assert diff.item() < 1e-4


def test_full_weight_sync_is_verified_on_every_engine(manager: RolloutManager, tiny_sd3_pipeline) -> None:
    import ray

    state = {k: v.detach().clone() for k, v in tiny_sd3_pipeline.transformer.state_dict().items()}
    state["proj_out.bias"] += 0.05
    manager.update_weights(state, 1)
    metrics = manager.sync_metrics()
    params = sum(1 for _ in tiny_sd3_pipeline.transformer.named_parameters())
    assert metrics["sync/verified_tensors"] == params == 66
    assert metrics["sync/engines"] == 2 and metrics["sync/engines_agree"] == 1.0
    # the check is real: a tensor the engine does not hold is named
    from miles.rollout.engines.sglang.sync import tensor_sha256

    wrong = {"proj_out.bias": tensor_sha256(state["proj_out.bias"] + 1e-3)}
    with pytest.raises(Exception, match=r"proj_out\.bias"):
        ray.get(manager.engines[0].verify_weights.remote(wrong))
    # what the engines now generate is the updated model's
    transformer = type(tiny_sd3_pipeline.transformer).from_config(tiny_sd3_pipeline.transformer.config)
    transformer.load_state_dict(state)
    s = manager.run_requests(_requests(manager, 1))[0]
    assert (_recompute_log_probs(transformer, s) - s.trajectory.log_probs).abs().max().item() < 1e-4
    assert (_recompute_log_probs(tiny_sd3_pipeline.transformer, s) - s.trajectory.log_probs).abs().max().item() > 1e-3


def test_a_killed_engine_is_restarted_under_fault_tolerance(manager: RolloutManager) -> None:
    before = manager.engine_info()
    victim = before[1]["pid"]
    requests = _requests(manager, 16)
    import threading

    killer = threading.Timer(1.0, lambda: os.kill(victim, signal.SIGKILL))
    killer.start()
    samples = manager.run_requests(requests)
    killer.join()
    assert len(samples) == 64 and all(s.trajectory is not None for s in samples)
    deadline = time.monotonic() + 120
    while not manager.restart_log() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = manager.restart_log()
    assert len(log) == 1 and log[0]["engine"] == 1
    after = manager.engine_info()
    assert after[1]["pid"] != victim and after[1]["restarts"] == 1 and after[0]["pid"] == before[0]["pid"]
    assert sorted(manager.sglang.router.workers()) == sorted(info["url"] for info in after)
    # the restarted engine got the last synced weights back, verified
    import ray

    checksums = ray.get([engine.weights_checksum.remote() for engine in manager.engines])
    assert checksums[0] == checksums[1]


def test_a_killed_engine_actor_is_replaced_by_a_new_actor(manager: RolloutManager) -> None:
    """The actor itself gone (its process, or its node): its server cannot be restarted in it; a new actor (on a
    live node) starts a new server, which gets the last synced weights and goes back into the router."""
    import ray

    before = manager.engine_info()
    old = manager.engines[0]
    restarts = len(manager.restart_log())
    ray.kill(old, no_restart=True)  # its server ends with it (it dies with its parent)
    samples = manager.run_requests(_requests(manager, 4))  # meanwhile the router sends everything to engine 1
    assert len(samples) == 16 and all(s.trajectory is not None for s in samples)
    deadline = time.monotonic() + 180
    while len(manager.restart_log()) == restarts and time.monotonic() < deadline:
        time.sleep(0.5)
    log = manager.restart_log()
    assert len(log) == restarts + 1 and log[-1]["engine"] == 0
    after = manager.engine_info()
    assert manager.engines[0] is not old and after[0]["pid"] != before[0]["pid"]
    assert after[0]["restarts"] == before[0]["restarts"] + 1 and after[0]["url"] == log[-1]["new_url"]
    assert sorted(manager.sglang.router.workers()) == sorted(info["url"] for info in after)
    checksums = ray.get([engine.weights_checksum.remote() for engine in manager.engines])
    assert checksums[0] == checksums[1]  # the new actor's server holds the last synced weights


def test_lora_sync_goes_through_set_lora(manager: RolloutManager, tiny_sd3_pipeline) -> None:
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    from miles.models.lora_sync import lora_sync_payload, merge_lora_weight

    model = copy.deepcopy(tiny_sd3_pipeline.transformer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model = inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=generator) * 0.05
    payload = lora_sync_payload(model)
    base = {k: v.detach().clone() for k, v in tiny_sd3_pipeline.transformer.state_dict().items()}
    manager.update_weights(base, 2)  # back to the checkpoint's weights: the adapter's base
    manager.update_weights(payload, 3)
    metrics = manager.sync_metrics()
    assert metrics["sync/verified_tensors"] == 66 and metrics["sync/engines_agree"] == 1.0
    import ray

    active = ray.get([engine.active_lora.remote() for engine in manager.engines])
    assert [[a["nickname"] for a in engine] for engine in active] == [["miles-v3"], ["miles-v3"]]
    # the engines sample from base + B @ A * scaling
    merged = copy.deepcopy(tiny_sd3_pipeline.transformer)
    own = merged.state_dict()
    with torch.no_grad():
        for key in [k for k in payload if k.endswith(".lora_A")]:
            module = key[: -len(".lora_A")]
            scaling = float(payload[f"{module}.lora_scaling"])
            weight = own[f"{module}.weight"]
            weight.copy_(merge_lora_weight(weight, payload[key], payload[f"{module}.lora_B"], scaling))
    s = manager.run_requests(_requests(manager, 1))[0]
    assert (_recompute_log_probs(merged, s) - s.trajectory.log_probs).abs().max().item() < 1e-4


def test_without_fault_tolerance_a_dead_engine_stops_the_run_naming_it(manager: RolloutManager) -> None:
    manager.args.use_fault_tolerance = False
    victim = manager.engine_info()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(RolloutEngineError, match=r"sglang engine 0 at .*pid \d+.*--use-fault-tolerance"):
        for _ in range(3):
            manager.run_requests(_requests(manager, 2))
            time.sleep(1.0)
