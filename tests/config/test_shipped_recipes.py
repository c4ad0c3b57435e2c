"""Every shipped recipe checked as a user would before launch (fast, torch-free): it resolves, the batch-knob
invariant holds, the trained steps on its denoising grid draw no warning (each trained expert gets steps, no
candidate step without noise, no step index on another grid than its own), an RL recipe with eval data evaluates,
and a GPU recipe's memory plan fits the 80 GiB GPU it names, with its own placement. Then one recipe per rule that
breaks it, written to a file, to show the check catches it.

The provenance tables of the GPU recipes (docs/recipes.md) are checked by tests/config/test_recipe_provenance.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from miles.config.eval_schedule import evaluates, has_eval_data, schedule_text
from miles.config.jobs import JOBS
from miles.config.layering import load_config_file
from miles.config.recipes import find_recipe, shipped_recipes
from miles.config.resolve import ResolvedJob, resolve
from miles.core.errors import ConfigError
from miles.sampling.trained_steps import trained_steps, trains_sde_steps

RECIPES = shipped_recipes()
GPU_RECIPES = sorted(name for name in RECIPES if not name.startswith("tiny-"))
GPU_MEMORY_GIB = 80.0


def recipe_problems(recipe: str) -> list[str]:
    """What a user would want to hear about `recipe` (a shipped name or a YAML path) before launching it."""
    try:
        resolved = resolve(None, recipe=recipe)
    except ConfigError as exc:
        return [f"does not resolve: {exc}"]
    args, job = resolved.args, resolved.spec.name
    problems = [f"warning: {line}" for line in resolved.warnings]
    if args.rollout_batch_size is not None and job in ("rl", "dmd2", "rollout-only"):
        left = args.rollout_batch_size * args.n_samples_per_prompt
        right = args.global_batch_size * args.num_steps_per_rollout
        if left != right:
            problems.append(f"batch-knob invariant: {left} != {right}")
    if job == "rl" and has_eval_data(args) and not evaluates(args, job):
        problems.append("eval data that is never evaluated")
    if not load_config_file(Path(RECIPES.get(recipe, recipe))).data.get("hf_checkpoint", "").startswith("tiny-"):
        problems += plan_problems(resolved)
    return problems


def plan_problems(resolved: ResolvedJob) -> list[str]:
    """`miles plan`'s verdict on an 80 GiB GPU with the recipe's own placement (the cluster its flags describe)."""
    from miles.memory.report import memory_for
    from miles.placement.cluster import flags_cluster
    from miles.placement.plan import make_plan

    args = resolved.args.with_values({"gpu_memory_gib": GPU_MEMORY_GIB}, "cli")
    resolved = ResolvedJob(resolved.spec, args, resolved.trainers, resolved.trainer_args, resolved.warnings)
    estimate, _ = memory_for(resolved, make_plan(args, flags_cluster(args), resolved.spec))
    if estimate is None:
        return ["no memory plan"]
    if not estimate.fits():
        _, phase, nbytes = estimate.peak()
        return [f"memory plan: {estimate.with_margin(nbytes):.1f} GiB in {phase} on a {GPU_MEMORY_GIB:g} GiB GPU"]
    return []


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_shipped_recipe_is_sound(name: str) -> None:
    assert recipe_problems(name) == []


def test_the_gpu_recipes() -> None:
    assert GPU_RECIPES == [
        "cosmos3-pickscore-t2i",
        "flux-kontext-edit-grpo",
        "flux-pickscore-grpo",
        "flux2-klein-pickscore-grpo",
        "ltx23-pickscore-grpo",
        "qwen-image-edit-grpo",
        "qwen-image-pickscore-grpo",
        "sd3-ocr-grpo",
        "sd3-pickscore-nft",
        "sd35-4step",
        "wan22-i2v-grpo",
        "wan22-lora-sft",
        "wan22-pickscore-grpo",
        "z-image-pickscore-grpo",
    ]
    for name in GPU_RECIPES:  # each names the curve to expect
        assert load_config_file(RECIPES[name]).expect


def test_every_rl_recipe_with_eval_data_evaluates_on_a_curve() -> None:
    """The GPU RL recipes evaluate every --eval-interval; every training recipe with eval data evaluates at least
    after its last rollout (iteration)."""
    for name in sorted(RECIPES):
        resolved = resolve(None, recipe=name)
        args, job = resolved.args, resolved.spec.name
        if has_eval_data(args):
            assert evaluates(args, job) and schedule_text(args, job).endswith(
                ("after the last", "(set --eval-interval N for a curve)")
            ), name
        if name in GPU_RECIPES and job == "rl":
            assert args.eval_interval and schedule_text(args, job).startswith("before the first rollout, every "), name


def test_wan22_pickscore_grpo_trains_both_experts() -> None:
    """The recipe's candidate steps sit on both sides of the expert boundary (0.875) of its 10-step shift-3 grid."""
    found = trained_steps(resolve(None, recipe="wan22-pickscore-grpo").args)
    assert not isinstance(found, str), found
    owners = {found.grid.experts[i] for i in found.steps}
    assert owners == {"transformer", "transformer_2"}
    assert found.steps == (1, 2, 3)
    assert [round(found.grid.sigmas[i], 3) for i in found.steps] == [0.960, 0.913, 0.858]


def test_wan22_i2v_grpo_trains_both_experts() -> None:
    """The I2V recipe's candidate steps sit on both sides of the I2V checkpoint's expert boundary (0.9) of its
    8-step shift-5 grid: its anchors' steps (Flow-Factory's step 1, UniRL's 0-1) reach the high-noise expert only."""
    found = trained_steps(resolve(None, recipe="wan22-i2v-grpo").args)
    assert not isinstance(found, str), found
    assert found.steps == (1, 2, 3)
    assert [found.grid.experts[i] for i in found.steps] == ["transformer", "transformer", "transformer_2"]
    assert [round(found.grid.sigmas[i], 3) for i in found.steps] == [0.968, 0.926, 0.871]
    assert found.grid.experts[1] == found.grid.experts[0]  # step 1 alone (Flow-Factory's) trains one expert


# ---- recipes that break each rule --------------------------------------------------------------------------------
def _write(tmp_path: Path, base: str, **changes: object) -> str:
    data = load_config_file(RECIPES[base]).data
    data.update(changes)
    path = tmp_path / f"broken-{base}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_a_recipe_whose_batch_knobs_disagree_is_caught(tmp_path: Path) -> None:
    problems = recipe_problems(_write(tmp_path, "qwen-image-pickscore-grpo", global_batch_size=200))
    assert len(problems) == 1 and "does not resolve" in problems[0] and "global" in problems[0]


def test_a_two_expert_recipe_that_trains_one_expert_only_is_caught(tmp_path: Path) -> None:
    """The old wan22-pickscore-grpo: a 2-step window in [1, 4) on the checkpoint's 20-step shift-12 grid."""
    broken = _write(
        tmp_path,
        "wan22-pickscore-grpo",
        diffusion_num_steps=20,
        diffusion_flow_shift=None,
        diffusion_step_strategy_path="miles.sampling.step_strategies.sde_window",
        diffusion_num_sde_steps=2,
        diffusion_sde_candidate_steps=None,
        diffusion_sde_window_range="1,4",
    )
    (problem,) = recipe_problems(broken)
    assert "trains transformer_2, but none of the candidate SDE steps 1,2,3" in problem
    assert "(it denoises steps 13-19)" in problem and "never gets a gradient" in problem


def test_a_candidate_step_without_noise_is_caught(tmp_path: Path) -> None:
    """CPS's last step has sigma_next = 0, so its std is 0: nothing stochastic to train."""
    broken = _write(tmp_path, "ltx23-pickscore-grpo", diffusion_sde_candidate_steps="0,1,2,23")
    (problem,) = recipe_problems(broken)
    assert "candidate SDE step 23 of the 24-step grid has zero noise under --diffusion-sde-type cps" in problem


def test_step_indices_moved_to_another_grid_are_caught(tmp_path: Path) -> None:
    """cosmos3's candidates 8-11 were chosen on its 16-step grid: a later layer's 35 steps moves them to sigma ~0.93
    (the old recipe set both in one file, which no rule can tell apart from a choice; the layers can)."""
    found = resolve(None, recipe="cosmos3-pickscore-t2i", cli={"diffusion_num_steps": 35})
    (problem,) = found.warnings
    assert problem.startswith("--diffusion-sde-candidate-steps 8,9,10,11 (recipe) were chosen on a 16-step grid")
    assert "--diffusion-num-steps 35 (cli) changes the grid under them" in problem
    # the same change in a YAML that also names the steps is a choice, not a move
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("diffusion_num_steps: 35\ndiffusion_sde_candidate_steps: '20,21,22,23'\n")
    again = resolve(None, recipe="cosmos3-pickscore-t2i", cli={"custom_config_path": str(yaml_file)})
    assert not [w for w in again.warnings if "chosen on" in w]
    # a later layer that keeps the grid (a flag the grid does not read) moves nothing
    same = resolve(None, recipe="cosmos3-pickscore-t2i", cli={"diffusion_guidance_scale": 3.0})
    assert same.warnings == []


def test_eval_data_a_job_cannot_evaluate_is_said(tmp_path: Path) -> None:
    rollout = tmp_path / "rollout_{rollout_id}.pt"
    found = resolve(None, recipe="tiny-digits-grpo", cli={"load_debug_rollout_data": str(rollout), "train_only": True})
    assert found.warnings == [
        "--eval-prompt-data digits=digits:test (recipe) is not evaluated: training on saved rollouts starts no engine"
    ]
    assert not evaluates(found.args, "rl")
    # --debug-rollout-only trains nothing: a warning, and an --eval-interval there is refused
    found = resolve(None, recipe="tiny-digits-grpo", cli={"debug_rollout_only": True})
    assert found.warnings == [
        "--eval-prompt-data digits=digits:test (recipe) is not evaluated: --debug-rollout-only generates and scores, "
        "and trains nothing",
    ]
    with pytest.raises(ConfigError, match="--eval-interval 5 \\(cli\\): nothing is evaluated: --debug-rollout-only"):
        resolve(None, recipe="tiny-digits-grpo", cli={"debug_rollout_only": True, "eval_interval": 5})


def test_a_gpu_recipe_over_its_gpu_memory_is_caught(tmp_path: Path) -> None:
    """qwen-image-pickscore-grpo replicated instead of sharded (--dp-replicate-size 4): every rank holds the whole
    20 B-parameter model in fp32, over 80 GiB in the train phase."""
    (problem,) = recipe_problems(_write(tmp_path, "qwen-image-pickscore-grpo", dp_replicate_size=4))
    assert problem.startswith("memory plan: ") and "GiB in train on a 80 GiB GPU" in problem


def test_the_grid_checks_apply_to_methods_that_train_sde_steps_only() -> None:
    """NFT and DPO re-noise the final sample at fresh noise levels: their rollouts have no SDE step to check."""
    assert not trains_sde_steps(resolve(None, recipe="sd3-pickscore-nft").args, JOBS["rl"])
    assert not trains_sde_steps(resolve(None, recipe="tiny-digits-dpo").args, JOBS["rl"])
    assert trains_sde_steps(resolve(None, recipe="sd3-ocr-grpo").args, JOBS["rl"])
    assert not trains_sde_steps(resolve(None, recipe="sd3-ocr-grpo").args, JOBS["rollout-only"])


@pytest.mark.parametrize(
    ("cli", "why"),
    [
        ({"debug_rollout_only": True}, "--debug-rollout-only on (cli) trains nothing"),
        ({"loss_type": "nft", "use_ema": True}, "--loss-type nft (cli) trains an unguided forward"),
        ({"diffusion_true_cfg_scale": 1.0}, "CFG is off in training (--diffusion-true-cfg-scale 1.0 (cli)"),
    ],
)
def test_a_recipes_detach_that_another_flag_makes_inapplicable_falls_back_to_full(
    cli: dict, why: str, tmp_path: Path
) -> None:
    """A recipe (tiny-flux-kontext-edit-grpo's, with --diffusion-cfg-uncond-grad detach) whose detach another flag
    makes inapplicable: the user never typed it, so the recipe's value falls back to full, said in one warning. The
    same value typed on the command line is refused (the user's own flag is never ignored)."""
    shipped = find_recipe("tiny-flux-kontext-edit-grpo").path.read_text()
    recipe = tmp_path / "edit-detach.yaml"
    recipe.write_text(shipped.replace("diffusion_cfg_uncond_grad: full", "diffusion_cfg_uncond_grad: detach"))
    recipe = str(recipe)
    assert resolve(None, recipe=recipe).args.diffusion_cfg_uncond_grad == "detach"
    found = resolve(None, recipe=recipe, cli=cli)
    assert found.args.diffusion_cfg_uncond_grad == "full"
    [warning] = [w for w in found.warnings if w.startswith("--diffusion-cfg-uncond-grad")]
    assert warning.startswith(f"--diffusion-cfg-uncond-grad detach (recipe): {why}")
    assert warning.endswith("using --diffusion-cfg-uncond-grad full instead")
    with pytest.raises(ConfigError, match=r"^--diffusion-cfg-uncond-grad detach \(cli\): "):
        resolve(None, recipe=recipe, cli={**cli, "diffusion_cfg_uncond_grad": "detach"})


def test_a_recipes_eval_interval_on_saved_rollouts_is_dropped_with_a_warning(tmp_path: Path) -> None:
    """tiny-flux-kontext-edit-grpo evaluates every 10 rollouts; replaying its saved rollouts (`--train-only
    --load-debug-rollout-data`) starts no engine: the recipe's interval is dropped with one warning, while the same
    interval typed on the command line is refused."""
    saved = {"train_only": True, "load_debug_rollout_data": str(tmp_path / "rollout_{rollout_id}.pt")}
    assert resolve(None, recipe="tiny-flux-kontext-edit-grpo").args.eval_interval == 10
    found = resolve(None, recipe="tiny-flux-kontext-edit-grpo", cli=saved)
    assert found.args.eval_interval is None
    assert found.warnings == [
        "--eval-interval 10 (recipe): training on saved rollouts starts no engine to evaluate with; the recipe's "
        "value is not used"
    ]
    with pytest.raises(ConfigError, match=r"^--eval-interval 10 \(cli\): training on saved rollouts .*; remove it$"):
        resolve(None, recipe="tiny-flux-kontext-edit-grpo", cli={**saved, "eval_interval": 10})
