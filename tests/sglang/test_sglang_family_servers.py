"""flux and qwen_image on real sglang-diffusion servers (the tiny builds, fp32, 64x64, 4 steps).

One family at a time: a module-scoped manager per family (one Ray, one server), torn down before the
next family's starts. Per family: the rollout's trajectory in the natural latent layout and its conditions
in the family's keys; the trainer's recompute (`family.guided_velocity` with the in-process diffusers
transformer on the returned conditions, then `sde_step(..., prev_sample=...)`) giving back the server's
log-probs to 1e-4; a full weight sync and a LoRA sync, each verified tensor by tensor on the server and
changing what it samples.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config.resolve import resolve
from miles.rollout.manager import RolloutManager, build_requests
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

TOL = 1e-4
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
    "diffusion_height": 64,
    "diffusion_width": 64,
    "diffusion_forward_dtype": "fp32",
}
# family -> (checkpoint fixture, recipe, the true-CFG scales its requests are tried with). flux: embedded
# guidance alone; its true CFG on sglang is refused for the tiny build (sglang encodes the negative prompt at
# 512 T5 tokens, the checkpoint's text is 8; tests/config/test_rules.py)
FAMILIES: dict[str, tuple[str, str, tuple[float | None, ...]]] = {
    "flux": ("tiny_flux_dir", "tiny-flux-digits-grpo", (None,)),
    "qwen_image": ("tiny_qwen_image_dir", "tiny-qwen-image-digits-grpo", (4.0,)),  # true CFG with its rescale
}
RECIPE_OVERRIDES: dict[str, dict[str, Any]] = {"flux": {"diffusion_true_cfg_scale": 1.0}}


def cpu_blocker(name: str) -> str:
    """Why sglang cannot serve family `name` here ("" when it can: always with GPUs). The config rules refuse
    `--rollout-backend sglang` for such a family on a machine without GPUs (`sglang_cpu_blocker`)."""
    from miles.models.families import get_family
    from miles.utils.sglang_env import gpus_present

    return "" if gpus_present() else get_family(name).sglang_cpu_blocker


class Served:
    """One family's manager (one sglang engine) and its in-process transformer."""

    def __init__(self, name: str, manager: RolloutManager, checkpoint: Path) -> None:
        self.name = name
        self.manager = manager
        self.family = manager.sglang.family
        from miles.models.loading import quiet_loading

        with quiet_loading():
            self.pipe = self.family.load_pipeline_class().from_pretrained(checkpoint, torch_dtype=torch.float32)
        self.transformer = self.pipe.transformer.eval()
        # the parameters as sglang's port holds them (qwen_image: the text q/k/v fused into one)
        self.engine_params = len(self.family.to_engine_tensors(dict(self.transformer.named_parameters())))

    def samples(self, true_cfg_scale: float | None, groups: int = 1) -> list[Any]:
        args = copy.copy(self.manager.args)
        args.diffusion_true_cfg_scale = true_cfg_scale
        requests = build_requests(args, self.manager.data_source.get_samples(groups), self.manager.strategy)
        return self.manager.run_requests(requests)

    def transformer_with(self, state: dict[str, torch.Tensor]) -> Any:
        model = copy.deepcopy(self.transformer)
        model.load_state_dict(state)
        return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import ray

    name = request.param
    blocker = cpu_blocker(name)
    if blocker:
        pytest.skip(f"sglang cannot serve {name} without a GPU: {blocker}")
    fixture, recipe, _ = FAMILIES[name]
    checkpoint = request.getfixturevalue(fixture)
    out = tmp_path_factory.mktemp(f"sglang_{name}")
    cli = {**CLI, **RECIPE_OVERRIDES.get(name, {}), "hf_checkpoint": str(checkpoint), "output_dir": str(out)}
    args = resolve("rl", recipe=recipe, cli=cli).args
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2
    )
    try:
        manager = RolloutManager(args, use_ray_engines=True)
        try:
            yield Served(name, manager, checkpoint)
        finally:
            manager.shutdown()
    finally:
        ray.shutdown()


def recompute_log_probs(family: Any, transformer: Any, sample: Any) -> torch.Tensor:
    """The trainer's view of one sample: the guided velocity on its conditions, then the SDE transition's
    log-prob of the latent the engine recorded next."""
    traj, cond = sample.trajectory, sample.conditions
    pos = stack_conditions([sample], negative=False, family=family)
    neg = stack_conditions([sample], negative=True, family=family) if cond.guidance_scale > 1.0 else None
    out = []
    for i in traj.sde_step_indices:
        x = traj.latents[i][None]
        with torch.no_grad():
            v = family.guided_velocity(transformer, x, traj.timesteps[i].expand(1), pos, neg, cond.guidance_scale)
        res = sde_step(
            v,
            x,
            traj.sigmas[i],
            traj.sigmas[i + 1],
            sde_type=traj.sde_type,
            noise_level=traj.noise_level,
            sigma_max=traj.sigmas[1],
            prev_sample=traj.latents[i + 1][None],
        )
        out.append(res.log_prob[0])
    return torch.stack(out)


def max_diff(served: Served, transformer: Any, samples: list[Any]) -> float:
    return max(
        (recompute_log_probs(served.family, transformer, s) - s.trajectory.log_probs).abs().max().item()
        for s in samples
    )


def test_rollout_is_in_the_natural_layout_and_the_recompute_matches(served: Served) -> None:
    family = served.family
    for true_cfg in FAMILIES[served.name][2]:
        samples = served.samples(true_cfg, groups=2)
        assert len(samples) == 4
        cfg = family.cfg_scale(float(served.manager.args.diffusion_guidance_scale), true_cfg)
        for s in samples:
            traj, cond = s.trajectory, s.conditions
            assert traj.latents.shape == (STEPS + 1, 4, 8, 8)  # unpacked from sglang's [T+1, 16, 16]
            assert traj.sigmas.shape == (STEPS + 1,) and traj.timesteps.shape == (STEPS,)
            assert len(traj.sde_step_indices) == 2 and torch.isfinite(traj.log_probs).all()
            assert set(cond.positive) == set(family.condition_inputs)
            assert (cond.negative is not None) == (cfg > 1.0)
            assert cond.guidance_scale == (cfg if cfg > 1.0 else 1.0)
            if cond.negative is not None:
                assert set(cond.negative) == set(family.condition_inputs)
            assert s.image.shape == (3, 64, 64)
        # the image the reward saw is the one the final (unpacked) latent decodes to
        with torch.no_grad():
            decoded = family.decode_latents(served.pipe, torch.stack([s.trajectory.latents[-1] for s in samples]))
        image_diff = (decoded - torch.stack([s.image for s in samples])).abs().max().item()
        assert image_diff < 1e-4, image_diff
        diff = max_diff(served, served.transformer, samples)
        print(f"{served.name} true_cfg={true_cfg}: max |log-prob diff| {diff:.3e}, max |image diff| {image_diff:.1e}")
        assert diff <= TOL, (served.name, true_cfg)


def test_embedded_guidance_and_text_length_are_the_jobs(served: Served) -> None:
    """FLUX's guidance input is the server's `--embedded-cfg-scale` (the job's guidance scale) and its T5
    tokens are the checkpoint's length (a request field: sglang pads to 512 otherwise)."""
    if "guidance" not in served.family.condition_inputs:
        pytest.skip("no embedded guidance")
    (sample, *_) = served.samples(None)
    assert sample.conditions.positive["guidance"].item() == float(served.manager.args.diffusion_guidance_scale)
    length = served.manager.sglang.max_sequence_length
    assert sample.conditions.positive["encoder_hidden_states"].shape == (length, 64)


def test_full_weight_sync_changes_what_the_server_samples(served: Served) -> None:
    state = {k: v.detach().clone() for k, v in served.transformer.state_dict().items()}
    state["proj_out.bias"] += 0.05
    served.manager.update_weights(state, 1)
    metrics = served.manager.sync_metrics()
    assert metrics["sync/verified_tensors"] == served.engine_params and metrics["sync/engines_agree"] == 1.0
    true_cfg = FAMILIES[served.name][2][-1]
    samples = served.samples(true_cfg, groups=2)
    new, old = max_diff(served, served.transformer_with(state), samples), max_diff(served, served.transformer, samples)
    print(f"{served.name} full sync: max |log-prob diff| {new:.3e} (the old weights: {old:.3e})")
    assert new <= TOL < old  # the old weights no longer explain them


def test_lora_sync_changes_what_the_server_samples(served: Served) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    from miles.models.lora_sync import lora_sync_payload, merge_lora_weight

    model = copy.deepcopy(served.transformer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(served.family.lora_target_modules))
    model = inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=generator) * 0.2
    payload = lora_sync_payload(model)
    base = {k: v.detach().clone() for k, v in served.transformer.state_dict().items()}
    served.manager.update_weights(base, 2)  # back to the checkpoint's weights: the adapter's base
    served.manager.update_weights(payload, 3)
    metrics = served.manager.sync_metrics()
    assert metrics["sync/verified_tensors"] == served.engine_params  # every parameter, the merge recomputed
    merged = dict(base)
    for key in [k for k in payload if k.endswith(".lora_A")]:
        module = key[: -len(".lora_A")]
        weight = merged[f"{module}.weight"]
        scaling = float(payload[f"{module}.lora_scaling"])
        merged[f"{module}.weight"] = merge_lora_weight(weight, payload[key], payload[f"{module}.lora_B"], scaling)
    true_cfg = FAMILIES[served.name][2][-1]
    samples = served.samples(true_cfg, groups=2)
    new, old = (
        max_diff(served, served.transformer_with(merged), samples),
        max_diff(served, served.transformer, samples),
    )
    print(f"{served.name} LoRA sync: max |log-prob diff| {new:.3e} (the base weights: {old:.3e})")
    assert new <= TOL < old
