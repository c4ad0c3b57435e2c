"""Model-family registry and resolution (torch-free)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.core.errors import ConfigError
from miles.models.families import (
    FAMILY_ENV,
    family_from_checkpoint_name,
    registered_families,
    resolve_family,
    trainable_families,
)
from miles.models.pipeline_config import TrainPipelineConfig
from miles.models.sd3.config import SD3_LORA_TARGET_MODULES, SD3TrainPipelineConfig


def test_registered_keys():
    assert set(registered_families()) == {
        "sd3",
        "flux",
        "flux_kontext",
        "flux2",
        "z_image",
        "wan2_2",
        "wan2_2_i2v",
        "wan2_2_ti2v",
        "qwen_image",
        "qwen_image_edit",
        "ltx",
        "cosmos3",
    }
    assert trainable_families() == (
        "cosmos3",
        "flux",
        "flux2",
        "flux_kontext",
        "ltx",
        "qwen_image",
        "qwen_image_edit",
        "sd3",
        "wan2_2",
        "wan2_2_i2v",
        "wan2_2_ti2v",
        "z_image",
    )


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("stabilityai/stable-diffusion-3.5-medium", "sd3"),
        ("stabilityai/stable-diffusion-3-medium-diffusers", "sd3"),
        ("stabilityai/stable-diffusion-3.5-large", "sd3"),
        ("tiny-sd3", "sd3"),
        ("/home/me/.cache/miles/models/tiny-sd3/", "sd3"),
        ("/ckpts/sd3/checkpoint-500", "sd3"),
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan2_2"),
        ("my/wan2_2-finetune", "wan2_2"),
        ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan2_2_i2v"),
        ("tiny-wan2_2-i2v", "wan2_2_i2v"),
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan2_2_ti2v"),
        ("tiny-wan2_2-ti2v", "wan2_2_ti2v"),
        ("Qwen/Qwen-Image", "qwen_image"),
        ("tiny-qwen-image", "qwen_image"),
        ("black-forest-labs/FLUX.1-dev", "flux"),
        ("black-forest-labs/FLUX.1-schnell", "flux"),
        ("tiny-flux", "flux"),
        ("black-forest-labs/FLUX.1-Kontext-dev", "flux_kontext"),
        ("tiny-flux-kontext", "flux_kontext"),
        ("black-forest-labs/FLUX.2-klein-4B", "flux2"),
        ("black-forest-labs/FLUX.2-klein-base-9B", "flux2"),
        ("tiny-flux2-klein", "flux2"),
        ("Tongyi-MAI/Z-Image-Turbo", "z_image"),
        ("tiny-z-image", "z_image"),
        ("Qwen/Qwen-Image-Edit-2511", "qwen_image_edit"),
        ("tiny-qwen-image-edit", "qwen_image_edit"),
        ("Lightricks/LTX-2", "ltx"),
        ("nvidia/Cosmos3-Nano", "cosmos3"),
    ],
)
def test_name_patterns(name, key):
    assert family_from_checkpoint_name(name) == key
    assert resolve_family(name, env={}, require_trainable=False).name == key


def test_last_path_component_wins_over_parents():
    assert family_from_checkpoint_name("/data/ltx-runs/stable-diffusion-3.5-medium") == "sd3"


def test_local_dir_without_hint_uses_model_index(tmp_path):
    ckpt = tmp_path / "my-finetune"
    ckpt.mkdir()
    (ckpt / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    assert resolve_family(str(ckpt), env={}).name == "sd3"
    (ckpt / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(ConfigError, match="no model family matches"):
        resolve_family(str(ckpt), env={})


def test_sd3_family_contents():
    cfg = resolve_family("stabilityai/stable-diffusion-3.5-medium", env={})
    assert isinstance(cfg, SD3TrainPipelineConfig)
    assert cfg.pipeline_class == "diffusers.StableDiffusion3Pipeline"
    assert cfg.transformer_class == "diffusers.SD3Transformer2DModel"
    assert cfg.condition_inputs == ("encoder_hidden_states", "pooled_projections")
    assert cfg.weight_sync_targets == ("transformer",)
    assert set(SD3_LORA_TARGET_MODULES) == {
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    }
    assert cfg.cfg_combine(3.0, 1.0, 4.0) == 9.0  # neg + s * (pos - neg)
    assert cfg.prepare_cond_kwargs({"encoder_hidden_states": 1, "pooled_projections": 2, "x": 3}) == {
        "encoder_hidden_states": 1,
        "pooled_projections": 2,
    }
    with pytest.raises(KeyError, match="pooled_projections"):
        cfg.prepare_cond_kwargs({"encoder_hidden_states": 1})


def test_registered_classes_exist_in_diffusers():
    import diffusers

    names = set(dir(diffusers))  # the lazy module lists its names without importing them
    for key in registered_families():
        cfg = resolve_family(None, family=key, require_trainable=False)
        for dotted in (cfg.pipeline_class, cfg.transformer_class):
            module, _, attr = dotted.rpartition(".")
            assert module == "diffusers" and attr in names, (key, dotted)


def test_flag_beats_env_beats_name(monkeypatch):
    env = {FAMILY_ENV: "sd3"}
    # name alone
    assert resolve_family("Qwen/Qwen-Image", env={}, require_trainable=False).name == "qwen_image"
    # env beats the name
    assert resolve_family("Qwen/Qwen-Image", env=env).name == "sd3"
    # the flag beats the env
    assert resolve_family("tiny-sd3", family="ltx", env=env, require_trainable=False).name == "ltx"
    # env defaults to os.environ
    monkeypatch.setenv(FAMILY_ENV, "sd3")
    assert resolve_family("local/weights-without-hint").name == "sd3"
    monkeypatch.setenv(FAMILY_ENV, "")
    with pytest.raises(ConfigError):
        resolve_family("local/weights-without-hint")


def test_family_keys_are_normalized():
    assert resolve_family(None, family="SD3").name == "sd3"
    assert resolve_family(None, family="Qwen-Image", require_trainable=False).name == "qwen_image"
    assert resolve_family(None, family="wan2.2", require_trainable=False).name == "wan2_2"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_miles_family.py").write_text(
        textwrap.dedent(
            """
            from miles.models.sd3.config import SD3TrainPipelineConfig

            class MyConfig(SD3TrainPipelineConfig):
                name = "mine"
                lora_target_modules = ("attn.to_q", "attn.to_v")

            class Draft(SD3TrainPipelineConfig):
                name = "draft"
                trainable = False
                not_trainable_reason = "its forward is not written yet"

            INSTANCE = MyConfig()
            NOT_A_CONFIG = 42
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_miles_family"


def test_user_class_by_dotted_path(user_module):
    cfg = resolve_family("local/weights", config_path=f"{user_module}.MyConfig", env={})
    assert type(cfg).__name__ == "MyConfig" and cfg.lora_target_modules == ("attn.to_q", "attn.to_v")
    inst = resolve_family("local/weights", config_path=f"{user_module}.INSTANCE", env={})
    assert isinstance(inst, TrainPipelineConfig) and inst.name == "mine"
    # an explicit user class also beats the env var and the checkpoint name
    cfg = resolve_family("Qwen/Qwen-Image", config_path=f"{user_module}.MyConfig", env={FAMILY_ENV: "ltx"})
    assert cfg.name == "mine"


def test_user_class_errors(user_module):
    with pytest.raises(ConfigError, match=r"--train-pipeline-config-path .*expected a TrainPipelineConfig"):
        resolve_family("x", config_path=f"{user_module}.NOT_A_CONFIG", env={})
    with pytest.raises(ConfigError, match=r"--train-pipeline-config-path .*cannot import"):
        resolve_family("x", config_path=f"{user_module}.Missing", env={})
    with pytest.raises(ConfigError, match=r"cannot import"):
        resolve_family("x", config_path="no_such_pkg_xyz.Config", env={})


def test_unknown_family_suggests():
    with pytest.raises(ConfigError) as info:
        resolve_family("tiny-sd3", family="sd35", env={})
    msg = str(info.value)
    assert "--diffusion-model-family" in msg and "did you mean 'sd3'" in msg
    assert (
        "cosmos3, flux, flux2, flux_kontext, ltx, qwen_image, qwen_image_edit, sd3, wan2_2, wan2_2_i2v, "
        "wan2_2_ti2v, z_image" in msg
    )
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"env MILES_DIFFUSION_MODEL_FAMILY: unknown model family 'sdxl'"):
        resolve_family("tiny-sd3", env={FAMILY_ENV: "sdxl"})


def test_mutually_exclusive(user_module):
    with pytest.raises(ConfigError, match="--diffusion-model-family and --train-pipeline-config-path"):
        resolve_family("tiny-sd3", family="sd3", config_path=f"{user_module}.MyConfig", env={})


def test_no_family_matches():
    with pytest.raises(ConfigError, match=r"--hf-checkpoint 'org/mystery-model'.*--diffusion-model-family"):
        resolve_family("org/mystery-model", env={})
    with pytest.raises(ConfigError, match="no --hf-checkpoint"):
        resolve_family(None, env={})


def test_untrainable_family_is_a_config_error(user_module):
    """Every built-in family trains; a family registered without a training path (here a user's draft) is
    refused with one line naming where it was selected, its reason and the trainable families."""
    where = f"--train-pipeline-config-path {user_module}.Draft"
    with pytest.raises(ConfigError, match="not trainable") as info:
        resolve_family(hf_checkpoint="x/y", config_path=f"{user_module}.Draft", env={})
    msg = str(info.value)
    assert msg.startswith(where) and "its forward is not written yet" in msg and "\n" not in msg
    trainable = (
        "cosmos3, flux, flux2, flux_kontext, ltx, qwen_image, qwen_image_edit, sd3, wan2_2, wan2_2_i2v, "
        "wan2_2_ti2v, z_image"
    )
    assert f"trainable families: {trainable}" in msg
    assert (
        resolve_family("x/y", config_path=f"{user_module}.Draft", env={}, require_trainable=False).trainable is False
    )


def test_torch_free_imports():
    code = (
        "import sys\n"
        "import miles.models.families as f, miles.builtin.checkpoints, miles.models.sd3\n"
        "import miles.models.tiny.metadata as t\n"
        "import miles.builtin.names as names, miles_cli.models_cmd, miles_cli.data_cmd\n"
        "assert f.resolve_family('tiny-sd3', env={}).name == 'sd3'\n"
        "assert names.is_builtin_dataset('digits:train')\n"
        "assert t.max_sequence_length('tiny-sd3') == 8\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'sklearn', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_the_family_is_resolved_once_into_a_derived_value(tmp_path: Path) -> None:
    """The config matches the checkpoint to a family once and records the name; every later reader looks it up."""
    from miles.config.args import CLI, DERIVED
    from miles.config.resolve import resolve
    from miles.models.families import args_family

    job = resolve("rl", recipe="tiny-flux-digits-grpo")
    assert job.args.diffusion_model_family == "flux" and job.args.sources()["diffusion_model_family"] == DERIVED
    assert job.trainer_args["actor"].diffusion_model_family == "flux"
    # a checkpoint path that names no family resolves through the recorded name, not the path
    job.args.hf_checkpoint = str(tmp_path / "my-finetune")
    assert args_family(job.args).name == "flux"
    explicit = resolve("rl", recipe="tiny-digits-grpo", cli={"diffusion_model_family": "sd3"})
    assert explicit.args.sources()["diffusion_model_family"] == CLI
