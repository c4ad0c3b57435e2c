"""docs/recipes.md's provenance tables agree with the shipped GPU recipes.

Each GPU recipe has a `### <name>` section with an "Anchor:" line, an "Expect:" line (the recipe's `expect:`) and a
table `| setting | ours | anchor | source | same, or why not |`. A setting cell names its flags in backticks
(`--lr`, or `critic.--lr` for another trainer's value); the ours cell holds, in backticks and in the same order,
each flag's resolved value as `Flag.format` prints it (`""` stands for the empty string). Torch-free and fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from miles.builtin.names import is_builtin_model
from miles.config.catalog import FLAGS_BY_DEST
from miles.config.layering import ConfigFile, load_config_file
from miles.config.recipes import shipped_recipes
from miles.config.resolve import ResolvedJob, resolve

PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
COLUMNS = ["setting", "ours", "anchor", "source", "same, or why not"]
MIN_ROWS = 15
GPU_RECIPES = {
    "sd3-ocr-grpo",
    "sd3-pickscore-nft",
    "sd35-4step",
    "flux-pickscore-grpo",
    "flux2-klein-pickscore-grpo",
    "z-image-pickscore-grpo",
    "flux-kontext-edit-grpo",
    "qwen-image-pickscore-grpo",
    "qwen-image-edit-grpo",
    "wan22-pickscore-grpo",
    "wan22-i2v-grpo",
    "wan22-lora-sft",
    "cosmos3-pickscore-t2i",
    "ltx23-pickscore-grpo",
}
# every recipe's table covers these; an RL recipe's also the RL ones
REQUIRED = {
    "hf_checkpoint", "prompt_data", "diffusion_height", "diffusion_width", "lr", "weight_decay", "clip_grad",
    "use_lora", "lora_rank", "lora_alpha", "global_batch_size", "num_rollout", "eval_interval",
    "diffusion_forward_dtype", "fsdp_master_dtype", "actor_num_gpus_per_node", "loss_type",
}  # fmt: skip
REQUIRED_RL = {
    "diffusion_num_steps", "diffusion_noise_level", "diffusion_sde_type", "n_samples_per_prompt",
    "rollout_batch_size", "num_steps_per_rollout", "diffusion_clip_range", "diffusion_adv_clip_max",
    "diffusion_kl_beta", "ref_mode", "globalize_reward_std", "eval_prompt_data", "diffusion_eval_num_steps",
    "reward_weights",
}  # fmt: skip
# flags a recipe may set that do not change what the run learns (speed, memory, logging, where files go)
NOT_RESULT = {
    "actor_num_nodes", "colocate", "deterministic_mode", "gradient_checkpointing", "lora_ipc_weight_sync",
    "micro_batch_size", "micro_batch_size_sample", "micro_batch_size_tstep", "ocr_num_workers",
    "pickscore_batch_size", "pickscore_num_gpus_per_worker", "pickscore_num_workers",
    "rollout_health_check_interval", "rollout_microgroup_size", "rollout_parser_num_workers", "save",
    "save_interval", "update_weight_buffer_size", "use_miles_router", "wandb_project",
}  # fmt: skip
FLAG = re.compile(r"^(?:([a-z_]+)\.)?--([a-z0-9-]+)$")  # `--lr` or `critic.--lr`
TICKS = re.compile(r"`([^`]*)`")


@dataclass
class Section:
    name: str
    anchor: str = ""
    expect: str | None = None
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)


@cache
def resolved_recipe(name: str) -> ResolvedJob:
    return resolve(None, recipe=name)


@cache
def recipe_file(name: str) -> ConfigFile:
    return load_config_file(shipped_recipes()[name], f"recipe {name}")


def gpu_recipes() -> set[str]:
    """The shipped recipes whose model is not a built-in tiny one."""
    found = set()
    for name in shipped_recipes():
        checkpoint = recipe_file(name).data.get("hf_checkpoint")
        if not name.startswith("tiny-") and not is_builtin_model(checkpoint):
            found.add(name)
    return found


def parse_page(text: str) -> dict[str, Section]:
    """The page's `### name` sections: their Anchor and Expect lines and their table's header and rows."""
    sections: dict[str, Section] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("#"):
            section = Section(line[4:].strip()) if line.startswith("### ") else None
            if section is not None:
                sections[section.name] = section
        elif section is None:
            continue
        elif line.startswith("Anchor: "):
            section.anchor = line[len("Anchor: ") :].strip()
        elif line.startswith("Expect: "):
            section.expect = line[len("Expect: ") :].strip()
        elif line.startswith("|") and not set(line) <= set("|- "):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if section.header:
                section.rows.append(cells)
            else:
                section.header = cells
    return sections


def shown(role: str, dest: str, resolved: ResolvedJob) -> str:
    text = FLAGS_BY_DEST[dest].format(getattr(resolved.trainer_args[role], dest))
    return text if text else '""'


def check_section(name: str, section: Section | None, resolved: ResolvedJob) -> list[str]:
    """What is wrong with one recipe's section, one line per problem."""
    if section is None:
        return [f"{name}: no '### {name}' section"]
    problems = []
    if not section.anchor:
        problems.append(f"{name}: no 'Anchor: ...' line")
    expect = recipe_file(name).expect
    if section.expect != expect:
        problems.append(f"{name}: the 'Expect:' line is not the recipe's expect: {expect!r}")
    if section.header != COLUMNS:
        return [*problems, f"{name}: the table's columns are {section.header}, expected {COLUMNS}"]
    if len(section.rows) < MIN_ROWS:
        problems.append(f"{name}: {len(section.rows)} rows, expected at least {MIN_ROWS}")
    covered = set()
    for row in section.rows:
        if len(row) != len(COLUMNS) or not row[-1]:
            problems.append(f"{name}: row {row[0]!r} has {len(row)} cells or an empty last one")
            continue
        flags = [FLAG.match(item) for item in TICKS.findall(row[0])]
        values = TICKS.findall(row[1])
        if not all(flags):
            problems.append(f"{name}: {row[0]!r} has backticks that are not `--flag` or `role.--flag`")
            continue
        if len(values) != len(flags):
            problems.append(f"{name}: {row[0]!r} names {len(flags)} flags but ours shows {len(values)} values")
            continue
        for match, value in zip(flags, values, strict=True):
            role, dest = match.group(1) or "actor", match.group(2).replace("-", "_")
            if dest not in FLAGS_BY_DEST or role not in resolved.trainer_args:
                problems.append(f"{name}: {match.group(0)} is not a flag of a {name} trainer")
            elif value != shown(role, dest, resolved):
                expected = shown(role, dest, resolved)
                problems.append(f"{name}: {match.group(0)} is `{value}`, the recipe's is `{expected}`")
            covered.add(dest if role == "actor" else f"{role}.{dest}")
    problems += [f"{name}: no row names {flag}" for flag in sorted(required_flags(name, resolved) - covered)]
    return problems


def required_flags(name: str, resolved: ResolvedJob) -> set[str]:
    """The flags a table must name: the core ones, and every flag the recipe sets that changes the result."""
    data = recipe_file(name).data
    need = REQUIRED | (REQUIRED_RL if resolved.spec.name == "rl" else set())
    if resolved.args.loss_type == "nft":
        need.discard("diffusion_clip_range")  # DiffusionNFT has no importance ratio to clip
    need |= {key for key in data if key in FLAGS_BY_DEST} - NOT_RESULT
    for role, values in (data.get("trainers") or {}).items():
        need |= {f"{role}.{key}" for key in values if key in FLAGS_BY_DEST and key not in NOT_RESULT}
    return need


def check_page(text: str) -> list[str]:
    sections = parse_page(text)
    problems: list[str] = []
    for name in sorted(GPU_RECIPES):
        problems += check_section(name, sections.get(name), resolved_recipe(name))
    return problems


def test_the_gpu_recipes_are_the_shipped_recipes_on_real_models() -> None:
    assert gpu_recipes() == GPU_RECIPES


def test_every_gpu_recipe_has_a_provenance_table_that_matches_it() -> None:
    problems = check_page(PAGE.read_text())
    assert not problems, "docs/recipes.md disagrees with the recipes:\n" + "\n".join(problems)


def test_a_doctored_table_is_reported(tmp_path: Path) -> None:
    text = PAGE.read_text()
    row = "| noise level, SDE type `--diffusion-noise-level` `--diffusion-sde-type` | `0.9` `sde` |"
    assert text.count(row) == 3  # flux, wan22 and flux-kontext (flux's comes first)
    doctored = tmp_path / "recipes.md"
    doctored.write_text(text.replace(row, row.replace("`0.9`", "`0.8`"), 1))
    problems = check_page(doctored.read_text())
    assert problems == ["flux-pickscore-grpo: --diffusion-noise-level is `0.8`, the recipe's is `0.9`"]


def test_a_missing_row_and_an_empty_reason_are_reported() -> None:
    text = PAGE.read_text()
    lr_row = next(line for line in text.splitlines() if line.startswith("| lr `--lr` | `0.0003` |"))
    no_reason = lr_row[: lr_row.rstrip(" |").rfind("|")] + "|  |"
    problems = check_page(text.replace(lr_row, no_reason, 1))
    assert problems == [
        "sd3-ocr-grpo: row 'lr `--lr`' has 5 cells or an empty last one",
        "sd3-ocr-grpo: no row names lr",
    ]
