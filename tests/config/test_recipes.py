"""Every shipped recipe resolves under its own job and round-trips through the exported YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles.config.export import to_json_dict, to_yaml_mapping, to_yaml_text
from miles.config.layering import load_config_file
from miles.config.recipes import find_recipe, shipped_recipes
from miles.config.resolve import ResolvedJob, resolve

RECIPES = shipped_recipes()
NAMES = sorted(RECIPES)
EXPECTED = {
    "sd3-ocr-grpo",
    "sd3-pickscore-nft",
    "sd35-4step",
    "tiny-digits-4step",
    "tiny-digits-grpo",
    "tiny-digits-sft",
    "tiny-flux-digits-sft",
    "tiny-flux-digits-grpo",
    "tiny-qwen-image-digits-sft",
    "tiny-qwen-image-digits-grpo",
    "qwen-image-pickscore-grpo",
    "qwen-image-edit-grpo",
    "flux-pickscore-grpo",
    "flux-kontext-edit-grpo",
    "tiny-wan2_2-digits-sft",
    "tiny-wan2_2-digits-grpo",
    "tiny-wan2_2-i2v-sft",
    "tiny-wan2_2-i2v-grpo",
    "wan22-pickscore-grpo",
    "wan22-i2v-grpo",
    "wan22-lora-sft",
}


def trainers_json(resolved: ResolvedJob) -> dict[str, dict[str, Any]]:
    """Per-trainer values, all roles, without `custom_config_path`.

    The round trip points `--custom-config-path` at the exported file, so that one value differs
    by design (the export leaves it out); every other value must survive.
    """
    trainers = to_json_dict(resolved.spec.name, resolved.trainer_args)["trainers"]
    return {role: {k: v for k, v in values.items() if k != "custom_config_path"} for role, values in trainers.items()}


def test_the_shipped_recipes() -> None:
    assert set(RECIPES) >= EXPECTED
    for name, path in RECIPES.items():
        assert path.suffix == ".yaml"
        assert find_recipe(name).path == path


@pytest.mark.parametrize("name", NAMES)
def test_recipe_has_a_job_and_a_one_line_description(name: str) -> None:
    cfg = load_config_file(RECIPES[name], f"recipe {name}")
    assert cfg.job in ("rl", "sft", "dmd2", "eval", "rollout-only", "replay")
    description = cfg.data.get("description")
    assert isinstance(description, str)
    assert description.strip()
    assert "\n" not in description.strip()


@pytest.mark.parametrize("name", NAMES)
def test_recipe_resolves_under_its_own_job(name: str) -> None:
    job = load_config_file(RECIPES[name]).job
    resolved = resolve(job, recipe=name)
    assert resolved.spec.name == job
    assert resolved.recipe == f"recipe {name}"
    assert resolve(None, recipe=name).spec.name == job
    # The batch-knob invariant holds for every recipe that generates or trains.
    args = resolved.args
    if args.rollout_batch_size is not None:
        assert (
            args.rollout_batch_size * args.n_samples_per_prompt == args.global_batch_size * args.num_steps_per_rollout
        )


def test_sd35_4step_has_a_critic_then_the_actor() -> None:
    resolved = resolve("dmd2", recipe="sd35-4step")
    assert [trainer.role for trainer in resolved.trainers] == ["critic", "actor"]
    critic, actor = resolved.trainer_args["critic"], resolved.trainer_args["actor"]
    differing = {dest for dest in critic if getattr(critic, dest) != getattr(actor, dest)}
    assert {"loss_type", "use_lora", "lora_ipc_weight_sync", "save"} <= differing
    for dest in differing:
        assert critic.source_of(dest) == "override:critic", dest
    overridden = {dest for dest, source in critic.sources().items() if source == "override:critic"}
    assert overridden == differing
    assert (critic.loss_type, actor.loss_type) == ("dmd2_critic", "dmd2")
    assert (critic.use_lora, actor.use_lora) == (False, True)
    assert critic.save == "/root/checkpoints/sd35-4step/critic"
    assert not any(source.startswith("override:") for source in actor.sources().values())


@pytest.mark.parametrize("name", NAMES)
def test_yaml_round_trip(name: str, tmp_path: Path) -> None:
    resolved = resolve(None, recipe=name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(to_yaml_text(resolved.args))

    again = resolve(None, cli={"custom_config_path": str(path)})

    assert again.spec.name == resolved.spec.name
    assert [t.role for t in again.trainers] == [t.role for t in resolved.trainers]
    assert trainers_json(again) == trainers_json(resolved)
    assert again.warnings == []
    # Everything the recipe set is now set by the YAML.
    for dest, source in resolved.args.sources().items():
        if source not in ("default", "derived"):
            assert again.args.source_of(dest) == "yaml", dest


@pytest.mark.parametrize("name", NAMES)
def test_yaml_mapping_leaves_defaults_and_the_config_path_out(name: str) -> None:
    resolved = resolve(None, recipe=name)
    mapping = to_yaml_mapping(resolved.args)
    assert mapping["job"] == resolved.spec.name
    sources = resolved.args.sources()
    for key in mapping:
        if key not in ("job", "trainers"):
            assert sources[key] != "default", key
    assert "custom_config_path" not in mapping


def test_yaml_round_trip_of_eval_with_a_training_recipe(tmp_path: Path) -> None:
    resolved = resolve("eval", recipe="tiny-digits-grpo")
    path = tmp_path / "eval.yaml"
    path.write_text(to_yaml_text(resolved.args))
    again = resolve(None, cli={"custom_config_path": str(path)})
    assert trainers_json(again) == trainers_json(resolved)


@pytest.mark.parametrize(
    ("name", "family", "cfg"),
    [
        ("tiny-flux-digits-grpo", "flux", 4.0),
        ("tiny-qwen-image-digits-grpo", "qwen_image", 4.0),
        ("qwen-image-pickscore-grpo", "qwen_image", 4.0),
        ("flux-pickscore-grpo", "flux", 1.0),
        ("flux-kontext-edit-grpo", "flux_kontext", 1.0),
        ("qwen-image-edit-grpo", "qwen_image_edit", 4.0),
        ("tiny-wan2_2-digits-grpo", "wan2_2", 4.0),
        ("tiny-wan2_2-i2v-sft", "wan2_2_i2v", 4.0),
        ("tiny-wan2_2-i2v-grpo", "wan2_2_i2v", 4.0),
        ("wan22-pickscore-grpo", "wan2_2", 4.0),
        ("wan22-i2v-grpo", "wan2_2_i2v", 3.5),
    ],
)
def test_family_recipes_resolve_their_family_and_guidance(name: str, family: str, cfg: float) -> None:
    """Each family recipe picks its family from the checkpoint name; the two-branch CFG scale it will run."""
    from miles.models.families import resolve_family

    args = resolve(None, recipe=name).args
    config = resolve_family(args.hf_checkpoint, env={})
    assert config.name == family
    assert config.cfg_scale(args.diffusion_guidance_scale, args.diffusion_true_cfg_scale) == cfg


@pytest.mark.parametrize(
    ("name", "frames", "stride"),
    [
        ("tiny-wan2_2-digits-sft", 5, 2),
        ("tiny-wan2_2-digits-grpo", 5, 1),
        ("tiny-wan2_2-i2v-sft", 5, 2),
        ("tiny-wan2_2-i2v-grpo", 5, 1),
        ("wan22-pickscore-grpo", 5, 1),
        ("wan22-lora-sft", 81, 2),
    ],
)
def test_wan_recipes_train_both_experts_on_frames(name: str, frames: int, stride: int) -> None:
    args = resolve(None, recipe=name).args
    assert list(args.update_weight_target_module) == ["transformer", "transformer_2"]
    assert args.diffusion_output_num_frames == frames and args.sft_frame_stride == stride
    if args.eval_prompt_data or name.endswith("grpo"):
        assert args.diffusion_guidance_scale == 4.0 and args.diffusion_guidance_scale_2 == 3.0
