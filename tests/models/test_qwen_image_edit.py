"""qwen_image_edit (Qwen-Image-Edit-Plus: 2509, 2511) through the in-process engine, against diffusers'
`QwenImageEditPlusPipeline`, on the embedded tiny-qwen-image-edit (2511's `zero_cond_t` DiT config, a Qwen2.5-VL text
encoder that sees the source, the source's packed tokens after the generated ones).

With noise level 0 the engine, given a prompt row's source image, reproduces the pipeline's latents and images to
1e-5, with one branch and with true CFG (the negative encoded with the same source); the recorded text states depend
on the source (the vision-language encoder saw it); a recorded SDE transition recomputed the trainer's way
(`guided_velocity` on the collated conditions, the source tokens among them) gives back the rollout's log-prob to
1e-6; the trajectory holds the generated latents only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from miles.config.resolve import resolve
from miles.models.flux.config import unpack_latents
from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import DiffusersEngine
from miles.sampling.sde import sde_step
from miles.training.pairs import stack_conditions

PROMPT = "make it a 5"
CASES = {
    "one-branch": ({"diffusion_true_cfg_scale": 1.0}, {"true_cfg_scale": 1.0}),
    "true-cfg": ({"diffusion_true_cfg_scale": 4.0}, {"true_cfg_scale": 4.0, "negative_prompt": " "}),
}


@pytest.fixture(scope="module")
def tiny_qwen_image_edit_dir(miles_session_home: Path) -> Path:
    """tiny-qwen-image-edit with a 5-step VAE fit: the tests need its layout, not its reconstructions."""
    from miles.builtin.tiny.qwen_image_edit import build_tiny_qwen_image_edit
    from miles.models.tiny.metadata import current_design

    name = f"tiny-qwen-image-edit-design{current_design('tiny-qwen-image-edit')}-vae5"
    path = miles_session_home / "test-builds" / name
    if not (path / "model_index.json").is_file():
        build_tiny_qwen_image_edit(path, progress=False, vae_steps=5)
    return path


@pytest.fixture(params=sorted(CASES))
def case(
    request: pytest.FixtureRequest, tiny_qwen_image_edit_dir: Path, make_engine
) -> tuple[str, DiffusersEngine, dict]:
    return (request.param, *_engine_of(request.param, tiny_qwen_image_edit_dir, make_engine))


def _engine_of(name: str, checkpoint: Path, make_engine) -> tuple[DiffusersEngine, dict]:
    """The engine of case `name` (made once per module) and the pipeline's arguments for the same guidance."""
    flags, pipe_kwargs = CASES[name]
    return make_engine(checkpoint, rollout_batch_size=2, diffusion_num_sde_steps=3, **flags), pipe_kwargs


def _request(engine: DiffusersEngine, media: tuple[Path, ...], noise_level: float, sde_steps, seeds, steps: int = 6):
    args = engine.args
    return GenerateRequest(
        prompt=PROMPT,
        metadata={"label": 5},
        group_index=0,
        indices=list(range(len(seeds))),
        seeds=list(seeds),
        sde_steps=sde_steps,
        num_steps=steps,
        guidance_scale=float(args.diffusion_guidance_scale),
        noise_level=noise_level,
        sde_type="sde",
        height=64,
        width=64,
        negative_prompt=" ",
        true_cfg_scale=args.diffusion_true_cfg_scale,
        media=tuple(str(p) for p in media),
    )


def _pipeline_latents(engine: DiffusersEngine, media: tuple[Path, ...], seeds, pipe_kwargs, monkeypatch, **extra):
    """The pipeline's own call on the same inputs (its VAE-copy area set to the tiny build's, as the engine's)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    condition_area, vae_area = engine.family.image_areas(engine.pipe)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", condition_area)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", vae_area)
    images = []
    for path in media:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return engine.pipe(
        image=images if len(images) > 1 else images[0],
        prompt=PROMPT,
        num_inference_steps=6,
        height=64,
        width=64,
        num_images_per_prompt=len(seeds),
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        **pipe_kwargs,
        **extra,
    ).images


@pytest.mark.slow
def test_the_engine_runs_the_plus_pipeline(case) -> None:
    from diffusers import QwenImageEditPlusPipeline

    _, engine, _ = case
    assert engine.family.name == "qwen_image_edit"
    assert isinstance(engine.pipe, QwenImageEditPlusPipeline)
    assert engine.pipe.processor is not None  # made from processor/ (no torchvision here)
    assert engine.pipe.transformer.config.zero_cond_t  # 2511's: the source tokens at timestep 0
    assert engine.family.image_areas(engine.pipe) == (384 * 384, 64 * 64)
    latent = engine.family.latent_shape(engine.pipe, 64, 64, 1)
    example = engine.family.example_media_conditions(latent, engine.pipe)  # the memory plan's source at 64 px
    source = engine.family.encode_sources(engine.pipe, [Image.new("RGB", (64, 64))])[1]["ref_tokens"]
    assert example["ref_tokens"][0] == tuple(source.shape[1:])
    assert engine.pipe.processor.image_processor.size["longest_edge"] == 56 * 56  # 4 image tokens per source


@pytest.mark.slow
def test_noise_level_zero_reproduces_the_pipeline(case, digit_pngs, monkeypatch) -> None:
    name, engine, pipe_kwargs = case
    seeds = [5, 6]
    samples = engine.generate([_request(engine, (digit_pngs[0],), 0.0, [[], []], seeds)])
    ours = torch.stack([s.trajectory.latents[-1] for s in samples])
    packed = _pipeline_latents(engine, (digit_pngs[0],), seeds, pipe_kwargs, monkeypatch, output_type="latent")
    ref = unpack_latents(packed.float(), 8, 8)
    assert ours.shape == ref.shape == (2, engine.family.latent_channels(engine.pipe), 8, 8)  # the generated part
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-5, (name, diff)
    images = _pipeline_latents(engine, (digit_pngs[0],), seeds, pipe_kwargs, monkeypatch, output_type="pt")
    got = torch.stack([s.image for s in samples])
    assert (got - images.float()).abs().max().item() <= 1e-5, name
    # the source's tokens and grid are recorded with both branches; the sample carries its source for rewards
    cond = samples[0].conditions
    assert cond.positive["ref_tokens"].shape == (16, 4 * engine.family.latent_channels(engine.pipe))
    assert cond.positive["ref_grid"].tolist() == [[8.0, 8.0]]
    if name == "true-cfg":
        assert torch.equal(cond.negative["ref_tokens"], cond.positive["ref_tokens"])
    else:
        assert cond.negative is None
    assert len(samples[0].sources) == 1 and samples[0].sources[0].shape == (3, 64, 64)


@pytest.mark.slow
def test_the_text_states_read_the_source(case, digit_pngs) -> None:
    """The recorded text states were encoded with the source: another source gives other states (and another
    edit); the prompt alone, without the picture, is shorter."""
    _, engine, _ = case
    a = engine.generate([_request(engine, (digit_pngs[0],), 0.0, [[]], [5])])[0]
    b = engine.generate([_request(engine, (digit_pngs[1],), 0.0, [[]], [5])])[0]
    text_a, text_b = a.conditions.positive["encoder_hidden_states"], b.conditions.positive["encoder_hidden_states"]
    assert text_a.shape == text_b.shape and (text_a - text_b).abs().max().item() > 1e-4
    alone, _ = engine.family.encode_prompts(engine.pipe, [PROMPT], None, False, engine.max_sequence_length)
    assert alone["encoder_hidden_states"].shape[1] < text_a.shape[0]
    assert (a.trajectory.latents[-1] - b.trajectory.latents[-1]).abs().max().item() > 1e-4


@pytest.mark.slow
def test_recorded_log_probs_are_reproduced_by_a_recompute(case, digit_pngs) -> None:
    name, engine, _ = case
    sde_steps = [[0, 1, 2], [2, 3], [4]]
    samples = engine.generate([_request(engine, (digit_pngs[0],), 0.7, sde_steps, seeds=(11, 12, 13))])
    family, pipe = engine.family, engine.pipe
    worst = 0.0
    for sample, steps in zip(samples, sde_steps, strict=True):
        traj = sample.trajectory
        assert traj.sde_step_indices == steps and traj.log_probs.shape == (len(steps),)
        assert traj.latents.shape[1:] == (family.latent_channels(pipe), 8, 8)  # no source tokens in x
        cfg = sample.conditions.guidance_scale
        pos = stack_conditions([sample], negative=False, family=family)
        neg = stack_conditions([sample], negative=True, family=family) if cfg > 1 else None
        for j, i in enumerate(steps):
            x = traj.latents[i][None]
            v = family.guided_velocity(pipe.transformer, x, traj.timesteps[i].expand(1), pos, neg, cfg)
            res = sde_step(
                v,
                x,
                traj.sigmas[i],
                traj.sigmas[i + 1],
                sde_type="sde",
                noise_level=0.7,
                sigma_max=traj.sigmas[1],
                prev_sample=traj.latents[i + 1][None],
            )
            worst = max(worst, abs(res.log_prob.item() - traj.log_probs[j].item()))
    assert worst <= 1e-6, (name, worst)


@pytest.mark.slow
def test_two_sources_reproduce_the_pipeline(
    tiny_qwen_image_edit_dir: Path, digit_pngs, make_engine, monkeypatch
) -> None:
    """Two pictures per row: "Picture 1", "Picture 2" in the text, both sources' tokens after the generated ones
    (RoPE frame indices 1 and 2), as the pipeline runs them."""
    engine, pipe_kwargs = _engine_of("one-branch", tiny_qwen_image_edit_dir, make_engine)
    media = (digit_pngs[0], digit_pngs[1])
    samples = engine.generate([_request(engine, media, 0.0, [[]], [7])])
    packed = _pipeline_latents(engine, media, [7], pipe_kwargs, monkeypatch, output_type="latent")
    assert (samples[0].trajectory.latents[-1][None] - unpack_latents(packed.float(), 8, 8)).abs().max() <= 1e-5
    assert samples[0].conditions.positive["ref_tokens"].shape[0] == 32
    assert samples[0].conditions.positive["ref_grid"].tolist() == [[8.0, 8.0], [8.0, 8.0]]


def test_a_traced_source_takes_the_outputs_aspect() -> None:
    """Under the memory plan's fake tensors a recorded grid cannot be read: K sources share the traced tokens equally,
    each with the output's aspect (a square output: a square source of any size, e.g. the ~1 MP VAE copy after a
    512 px output), tokens K sources cannot share are refused; a real grid is read as recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.models.qwen_image_edit.config import source_grids, traced_grid

    assert source_grids(torch.tensor([[6, 10], [8, 8]]), 31, (8, 8)) == [(6, 10), (8, 8)]
    assert source_grids(torch.tensor([[[6.0, 10.0]], [[6.0, 10.0]]]), 15, (8, 8)) == [(6, 10)]  # a batch's row 0
    with FakeTensorMode():
        fake = torch.empty(1, 2)
    assert source_grids(fake, 16, (8, 8)) == [(8, 8)]
    assert source_grids(fake, 4096, (64, 64)) == [(128, 128)]  # 512 px generated, the source's 1 MP VAE copy
    assert source_grids(torch.empty(2, 2, device="meta"), 32, (8, 8)) == [(8, 8), (8, 8)]
    assert traced_grid(52 * 78, (64, 96)) == (104, 156) and traced_grid(52 * 78, (96, 64)) == (156, 104)
    with pytest.raises(ValueError, match="only equal sources are traced"):
        source_grids(torch.empty(2, 2, device="meta"), 33, (8, 8))


def test_the_copies_are_the_pipelines() -> None:
    """The engine's and the memory plan's torch-free `copy_size` and areas are `QwenImageEditPlusPipeline`'s
    `calculate_dimensions` and module constants."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from miles.models.qwen_image_edit import config

    assert (config.CONDITION_IMAGE_SIZE, config.VAE_IMAGE_SIZE) == (plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE)
    for area in (plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE, 64 * 64):
        for w, h in ((512, 512), (64, 64), (640, 480), (480, 640), (1920, 1080), (333, 1999), (1024, 1024)):
            assert config.copy_size(area, w, h) == plus.calculate_dimensions(area, w / h), (area, w, h)


def test_the_plan_traces_the_source_the_engine_encodes(tmp_path: Path) -> None:
    """`miles plan`'s example source is the VAE copy the engine encodes, ~1 MP whatever the output: at
    qwen-image-edit-grpo's 512 x 512, 1,024 generated packed tokens and 4,096 of the source (not the output's 1,024);
    the pipeline's own sizes at other aspects; a tiny build's area from its metadata."""
    from types import SimpleNamespace

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from miles.memory import step
    from miles.memory.config_dirs import shipped_config_dir
    from miles.models.families import get_family
    from miles.models.qwen_image_edit.config import AREAS_KEY

    family = get_family("qwen_image_edit")
    args = resolve(None, recipe="qwen-image-edit-grpo").args
    configs = step.read_configs(shipped_config_dir(family, str(args.hf_checkpoint)))
    latent, conditions = step._shapes(family, configs, args, args.hf_checkpoint)
    shapes = {name: shape for name, shape, _ in conditions}
    assert latent == (16, 64, 64) and shapes["ref_tokens"] == (4096, 64) and shapes["ref_grid"] == (1, 2)
    for height, width in ((1024, 1024), (512, 768), (768, 512), (384, 1024)):
        args = resolve(None, recipe="qwen-image-edit-grpo", cli={"diffusion_height": height, "diffusion_width": width})
        _, conditions = step._shapes(family, configs, args.args, args.args.hf_checkpoint)
        vw, vh = plus.calculate_dimensions(plus.VAE_IMAGE_SIZE, width / height)
        assert dict((n, s) for n, s, _ in conditions)["ref_tokens"] == ((vh // 16) * (vw // 16), 64), (height, width)
    (tmp_path / "miles_tiny.json").write_text(json.dumps({AREAS_KEY: {"condition": 384 * 384, "vae": 64 * 64}}))
    tiny = SimpleNamespace(vae_scale_factor=8, name_or_path=str(tmp_path))
    assert family.example_media_conditions((16, 8, 8), tiny)["ref_tokens"] == ((16, 64), None)


def test_a_batch_takes_one_source_geometry() -> None:
    """Rows are padded to the longest text (qwen_image's collate) and their sources stacked; sources of other sizes
    in one batch are refused (the DiT takes one `img_shapes`), and a row comes back as it was."""
    from miles.models.families import get_family

    family = get_family("qwen_image_edit")

    def row(length: int, grid: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {
            "encoder_hidden_states": torch.randn(length, 4),
            "encoder_hidden_states_mask": torch.ones(length),
            "ref_tokens": torch.randn(grid[0] * grid[1] // 4, 16),
            "ref_grid": torch.tensor([list(grid)], dtype=torch.float32),
        }

    a, b = row(5, (8, 8)), row(7, (8, 8))
    batch = family.collate_conditions([a, b])
    assert batch["encoder_hidden_states"].shape == (2, 7, 4) and batch["ref_tokens"].shape == (2, 16, 16)
    back = family.condition_row(batch, 0)
    assert all(torch.equal(back[k], a[k]) for k in a)
    with pytest.raises(ValueError, match="one geometry per batch"):
        family.collate_conditions([a, row(5, (8, 4))])
    with pytest.raises(ValueError, match="one geometry per batch"):
        family.collate_conditions([a, {**row(5, (8, 8)), "ref_grid": torch.tensor([[4.0, 16.0]])}])


def test_the_family_resolves_and_refuses_sglang() -> None:
    from miles.models.families import resolve_family

    for name in ("Qwen/Qwen-Image-Edit-2511", "Qwen/Qwen-Image-Edit-2509", "tiny-qwen-image-edit"):
        assert resolve_family(name).name == "qwen_image_edit"
    assert resolve_family("Qwen/Qwen-Image").name == "qwen_image"
    family = resolve_family("tiny-qwen-image-edit")
    assert family.condition_images == (1, 3) and family.sglang_unserved


# ---- the rules and the memory plan (no model built) ----------------------------------------------------------------
REAL = "Qwen/Qwen-Image-Edit-2511"
SMALL = {
    "prompt_data": "digits-edit:train",  # rows with one condition image each (the rules' check; not read here)
    "rm_type": "digit_edit",
    "rollout_batch_size": 1,
    "n_samples_per_prompt": 4,
    "global_batch_size": 4,
    "micro_batch_size": 4,
    "actor_num_gpus_per_node": 1,
    "num_gpus_per_node": 1,
    "diffusion_num_steps": 6,
    "diffusion_num_sde_steps": 2,
    "diffusion_true_cfg_scale": 4.0,
}


def _fails(job: str, **cli) -> str:
    from miles.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve(job, cli={**SMALL, "hf_checkpoint": REAL, **cli})
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_rules_refuse_sglang_dmd2_offline_dpo_and_the_first_edit_model() -> None:
    import sys

    message = _fails("rl", rollout_backend="sglang", sglang_python=sys.executable)
    assert "model family 'qwen_image_edit'" in message and "condition images" in message
    assert resolve("rl", cli={**SMALL, "hf_checkpoint": REAL}).args.rollout_backend == "diffusers"  # auto
    assert "DMD2 samples its student from text alone" in _fails("dmd2")
    assert "offline DPO" in _fails("sft", loss_type="dpo", prompt_data="digits-preference:train")
    assert "QwenImageEditPipeline" in _fails("rl", hf_checkpoint="Qwen/Qwen-Image-Edit")


@pytest.mark.extended  # traces the real-size step on fake tensors: 68 s on 2 cores
def test_the_real_lora_grpo_plan_fits_80_gib(capsys: pytest.CaptureFixture) -> None:
    """`miles plan` of a LoRA Flow-GRPO job on the real Qwen-Image-Edit-2511 (its shipped configs) at the pipeline's
    1024 x 1024 with a source of that size, true CFG, one sample per micro-batch, on 4 colocated 80 GiB GPUs (the
    trainer shards the 20B DiT; one GPU cannot hold the trainer's and the engine's copies)."""
    import re

    from miles_cli.main import main

    flags = {
        **SMALL,
        "hf_checkpoint": REAL,
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 8,
        "rollout_microgroup_size": 8,
        "global_batch_size": 64,
        "micro_batch_size": 1,
        "diffusion_num_steps": 20,
        "diffusion_num_sde_steps": 2,
        "actor_num_gpus_per_node": 4,
        "num_gpus_per_node": 4,
        "colocate": True,
        "diffusion_height": 1024,
        "diffusion_width": 1024,
        "diffusion_forward_dtype": "bf16",
        "gradient_checkpointing": True,
        "use_lora": True,
        "lora_rank": 64,
        "lora_alpha": 128,
        "gpu_memory_gib": 80,
    }
    argv = ["plan", "--job", "rl"]
    for key, value in flags.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    rc = main(argv)
    out = capsys.readouterr()
    peak = float(re.search(r"memory: peak ([\d.]+) GiB per GPU", out.out).group(1))  # type: ignore[union-attr]
    print(f"Qwen-Image-Edit-2511 LoRA GRPO plan: peak {peak} GiB per GPU")
    assert rc == 0 and "fits" in out.out, out.err
    assert peak < 80
