"""The job table (`miles.config.jobs`): a job is one row. A toy job, added to a temporary copy of the table and
nowhere else, is registered by the CLI, placed, preflighted, scheduled, resolved and dispatched by reading its
properties; and no module outside the table branches on a job's name. Torch-free."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from miles.config.eval_schedule import evaluates, not_evaluated_reason, schedule_text
from miles.config.jobs import EVAL_ONCE, EVAL_PERIODIC, JOBS, JobSpec, job_names
from miles.core.errors import ConfigError, RuntimeUnavailable

ROOT = Path(__file__).resolve().parents[2]
CI = {"ci_metric_checker_key": "k", "ci_metric_checker_threshold": 1.0}


def toy_run(resolved: Any) -> int:
    """The toy job's driver (named by its row as `module:function`)."""
    return 7


class Toy(JobSpec):
    """A job that exists only in this test: train rl's phases under another name, command and schedule."""

    name = "toy"
    command = "train toy"
    cli_group = "train"
    driver = f"{__name__}:toy_run"
    summary = "A toy job of the job-table test."
    starts_engines = generates = trains = scores = needs_prompt_data = True
    alternates_rollout_and_training = trains_on_rollouts = saves_checkpoints = True
    reuses_recipes = True
    evaluation = EVAL_PERIODIC
    step_unit = "epoch"
    evaluates_before_first_step = False
    runs_ci_check = True


class QuietToy(JobSpec):
    """A top-level job that starts nothing, trains nothing and evaluates nothing."""

    name = "quiet-toy"
    command = "quiet-toy"
    driver = "miles.runtime.no_such_driver:run"
    summary = "A quiet toy job."
    reuses_recipes = True


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Toy:
    """The table with the toy jobs added (restored after the test)."""
    job = Toy()
    monkeypatch.setitem(JOBS, job.name, job)
    monkeypatch.setitem(JOBS, QuietToy.name, QuietToy())
    return job


def eval_args(**changes: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "eval_prompt_data": {"digits": "test.jsonl"},
        "eval_config": None,
        "eval_interval": 3,
        "skip_eval_before_train": False,
        "load_debug_rollout_data": None,
        "debug_rollout_only": False,
    }
    values.update(changes)
    return SimpleNamespace(**values)


# ---- the shipped rows say what the name lists they replaced said ------------------------------------------------
def test_the_shipped_rows_keep_the_jobs_of_every_former_name_list() -> None:
    def having(prop: str) -> set[str]:
        return set(job_names(lambda job: getattr(job, prop)))

    assert list(JOBS) == ["rl", "sft", "dmd2", "eval", "rollout-only", "replay"]
    assert having("starts_engines") == {"rl", "dmd2", "eval", "rollout-only"}  # ENGINE_JOBS, placement, manager
    assert having("alternates_rollout_and_training") == {"rl", "dmd2"}  # LOOP_JOBS
    assert having("saves_checkpoints") == {"rl", "sft", "dmd2"}  # TRAINING_JOBS
    assert {n for n, j in JOBS.items() if not j.reuses_recipes} == {"rl", "sft", "dmd2"}  # resolve's TRAINING_JOBS
    assert having("needs_prompt_data") == {"rl", "sft", "dmd2", "rollout-only"}  # PROMPT_DATA_JOBS
    assert having("gold_reward") == {"rl", "eval"}  # GOLD_JOBS
    assert having("guards_rewards") == {"rl"}
    assert [j.name for j in JOBS.values() if j.runs_ci_check] == ["rl", "sft", "dmd2", "eval"]  # CI_JOBS, in order
    assert having("trains_on_rollouts") == {"rl", "replay"}
    assert having("trains_on_dataset") == {"sft"}
    assert having("distills") == {"dmd2"}
    assert having("has_rollout_only_mode") == having("dumps_rollouts") == {"rl", "rollout-only"}
    assert having("dumps_train_data") == {"rl"}
    assert having("takes_rollout_file") == {"replay"}
    assert {n: j.evaluation for n, j in JOBS.items()} == {
        "rl": EVAL_PERIODIC,
        "sft": EVAL_PERIODIC,
        "dmd2": EVAL_PERIODIC,
        "eval": EVAL_ONCE,
        "rollout-only": None,
        "replay": None,
    }
    assert {n for n, j in JOBS.items() if j.step_unit == "iteration"} == {"sft", "dmd2"}
    assert {n for n, j in JOBS.items() if not j.evaluates_before_first_step} == {"dmd2"}
    assert {n: (j.cli_group, j.word) for n, j in JOBS.items()} == {
        "rl": ("train", "rl"),
        "sft": ("train", "sft"),
        "dmd2": ("train", "dmd2"),
        "eval": (None, "eval"),
        "rollout-only": (None, "rollout-only"),
        "replay": (None, "replay"),
    }
    assert {n: j.driver for n, j in JOBS.items()} == {
        "rl": "miles.runtime.train_rl:run",
        "sft": "miles.runtime.train_sft:run",
        "dmd2": "miles.runtime.train_dmd2:run",
        "eval": "miles.runtime.eval_job:run",
        "rollout-only": "miles.runtime.rollout_only:run",
        "replay": "miles.runtime.replay:run",
    }


def test_the_flag_scopes_read_the_job_and_method_tables() -> None:
    from miles.config.catalog import FLAGS_BY_DEST

    def scope(dest: str) -> set[str]:
        return set(FLAGS_BY_DEST[dest].jobs or ())

    assert scope("colocate") == scope("rollout_manager_node") == {"rl", "dmd2", "eval", "rollout-only"}
    assert scope("offload") == scope("offload_train") == {"rl", "dmd2"}
    assert scope("export_interval") == scope("export_merged") == {"rl", "sft", "dmd2"}
    assert scope("gold_rm_type") == {"rl", "eval"}
    assert scope("reward_guard") == {"rl"}
    assert scope("teacher_checkpoint") == {"dmd2"}
    assert scope("sft_frame_stride") == scope("chosen_key") == {"sft"}
    assert scope("diffusion_dpo_beta") == {"rl", "replay", "sft"}


# ---- a toy job, from the table alone -------------------------------------------------------------------------
def test_the_cli_registers_one_command_per_row() -> None:
    from miles_cli.main import add_job_commands

    root, train = typer.Typer(), typer.Typer()
    root.add_typer(train, name="train")
    add_job_commands(root, {"train": train}, [*JOBS.values(), Toy(), QuietToy()])
    assert [c.name for c in train.registered_commands] == ["rl", "sft", "dmd2", "toy"]
    assert [c.name for c in root.registered_commands] == ["eval", "rollout-only", "replay", "quiet-toy"]
    shown = CliRunner().invoke(root, ["train", "toy", "--help"])
    assert shown.exit_code == 0 and "A toy job of the job-table test." in shown.output
    assert "ROLLOUT.pt" in CliRunner().invoke(root, ["replay", "--help"]).output
    assert "ROLLOUT.pt" not in CliRunner().invoke(root, ["quiet-toy", "--help"]).output


def test_placement_and_the_manager_read_starts_engines_and_trains(toy: Toy) -> None:
    from miles.config.resolve import resolve
    from miles.placement.cluster import flags_cluster
    from miles.placement.manager_node import describe
    from miles.placement.plan import make_plan

    args = resolve(None, recipe="sd3-ocr-grpo").args

    def roles(job: JobSpec) -> set[str]:
        return {slot.role for slot in make_plan(args, flags_cluster(args), job).slots}

    assert roles(toy) == {"actor", "engine"}
    assert roles(QuietToy()) == set()
    assert describe(args, toy) == "rollout manager: the node the command runs on (--rollout-manager-node driver)"
    assert describe(args, QuietToy()) is None
    assert describe(SimpleNamespace(train_only=True), toy) is None


def test_the_preflight_reads_the_row(toy: Toy) -> None:
    from miles.preflight import CHECKS

    def checks(job: JobSpec) -> set[str]:
        return {check.name for check in CHECKS if check.applies(job)}

    everyone = {check.name for check in CHECKS if check.applies_to is None}
    assert checks(toy) - everyone == {"prompt data", "reward service", "--load", "--save", "rollout files"}
    assert checks(QuietToy()) == everyone
    assert checks(JOBS["sft"]) - everyone == {"prompt data", "--load", "--save"}
    assert checks(JOBS["replay"]) - everyone == {"rollout files"}


def test_the_eval_schedule_reads_the_row(toy: Toy) -> None:
    assert evaluates(eval_args(), "toy")
    assert schedule_text(eval_args(), "toy") == "every 3 epochs and after the last"
    assert schedule_text(eval_args(eval_interval=None), "toy") == (
        "after the last epoch only (set --eval-interval N for a curve)"
    )
    assert not_evaluated_reason(eval_args(load_debug_rollout_data="r.pt"), "toy") == (
        "training on saved rollouts starts no engine"
    )
    assert not evaluates(eval_args(), "quiet-toy")
    assert schedule_text(eval_args(), "quiet-toy") == (
        "not evaluated: `miles quiet-toy` generates (and scores) its prompts only"
    )
    # the shipped rows, as before
    assert schedule_text(eval_args(), "rl") == "before the first rollout, every 3 rollouts and after the last"
    assert schedule_text(eval_args(), "dmd2") == "every 3 iterations and after the last"
    assert schedule_text(eval_args(), "eval") == "every eval set, once"


def test_a_toy_job_resolves_and_its_rules_read_its_row(toy: Toy) -> None:
    from miles.config.resolve import resolve

    rl = resolve(None, recipe="tiny-digits-grpo")
    found = resolve("toy", recipe="tiny-digits-grpo")
    assert found.spec is toy and found.args.job == "toy"
    assert found.args.rollout_batch_size == rl.args.rollout_batch_size
    assert found.args.loss_type == rl.args.loss_type
    with pytest.raises(ConfigError, match=r"`miles train toy` has no rollout-only mode"):
        resolve("toy", recipe="tiny-digits-grpo", cli={"debug_rollout_only": True})
    with pytest.raises(ConfigError, match=r"\(jobs: rl, sft, dmd2, eval, toy\)"):
        resolve("quiet-toy", recipe="tiny-digits-grpo", cli={"ci_test": True, **CI})
    with pytest.raises(ConfigError, match=r"this is a `miles train rl` recipe, not one for `miles train sft`"):
        resolve("sft", recipe="tiny-digits-grpo")


def test_dispatch_runs_the_rows_driver(toy: Toy) -> None:
    from miles.runtime import _driver

    resolved = SimpleNamespace(spec=toy)
    assert _driver(resolved) is toy_run  # type: ignore[arg-type]
    with pytest.raises(RuntimeUnavailable, match=r"the `miles quiet-toy` runtime is not available yet"):
        _driver(SimpleNamespace(spec=QuietToy()))  # type: ignore[arg-type]


# ---- no module outside the table branches on a job's name ------------------------------------------------------
NAME_BRANCH = re.compile(
    r"""\b(?:job|spec)\.name\s*(?:==|!=)"""  # job.name == "sft", resolved.spec.name != "dmd2"
    r"""|\bjob\s*(?:==|!=)\s*["']"""  # job == "eval"
    r"""|\b(?:job|job\.name|spec\.name)\s+(?:not\s+)?in\s+(?:frozenset\(\s*)?[({\[]\s*["']"""  # job in ("rl", ...)
    r"""|\w*_JOBS\s*(?::[^=]*)?=\s*(?:frozenset\(\s*)?[({\[]\s*["']"""  # TRAINING_JOBS = ("rl", "sft", "dmd2")
)
TABLE = Path("miles/config/jobs.py")
# Tables of other things that name the jobs they apply to, by design: each method's jobs (the method table), and
# each rollout hook's jobs beside the words its refusal says them in.
NAME_LISTS_ALLOWED = {Path("miles/methods.py"), Path("miles/config/rules/hooks.py")}


def name_list(names: tuple[str, ...]) -> re.Pattern[str]:
    """A literal collection of job names only: ("rl", "replay"), frozenset({"dmd2"}), ("rl",); not a call's or a
    subscript's argument (`extra.get("sft")`, `FILES["sft"]`)."""
    one = "(?:" + "|".join(re.escape(f'"{name}"') for name in names) + ")"
    return re.compile(rf"(?<![\w)\]])[({{\[]\s*{one}(?:\s*,\s*{one})*\s*,?\s*[)}}\]]")


def name_branches(root: Path = ROOT, names: tuple[str, ...] = tuple(JOBS)) -> list[str]:
    lists = name_list(names)
    found = []
    for package in ("miles", "miles_cli"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == TABLE:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if NAME_BRANCH.search(line) or (rel not in NAME_LISTS_ALLOWED and lists.search(line)):
                    found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_no_module_outside_the_table_branches_on_a_job_name() -> None:
    assert name_branches() == [], "read the job's row (miles.config.jobs) instead of its name"


def test_the_guard_sees_each_kind_of_name_branch(tmp_path: Path) -> None:
    (tmp_path / "miles" / "config").mkdir(parents=True)
    (tmp_path / "miles_cli").mkdir()
    lines = [
        'if job.name == "sft":',
        'if resolved.spec.name != "dmd2":',
        'unit = "iteration" if job == "sft" else "rollout"',
        'if job in ("rl", "replay"):',
        'if job.name not in ("rl", "rollout-only"):',
        'CI_JOBS = ("rl", "sft")',
        'PROMPT_DATA_JOBS = frozenset({"rl", "sft"})',
        '_TRAIN_DUMPS = ("rl",)',
        'Check("rollout files", check, jobs=frozenset({"rl", "replay"}))',
        "ENGINE_JOBS = job_names(lambda job: job.starts_engines)",  # read from the table: fine
        "if cfg.job == spec.name:",  # a recipe's job against the job's: fine
        'evaluates(args, "dmd2")',  # a driver naming its own job: fine
        'dash.span("eval", rollout_id=0)',  # a word, not a job: fine
        'sft = extra.get("sft") or FILES["sft"]',  # a key: fine
    ]
    (tmp_path / "miles" / "x.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "miles" / "config" / "jobs.py").write_text('if job.name == "rl":\n')
    (tmp_path / "miles" / "methods.py").write_text('jobs=("rl", "replay")\n')
    hits = [hit.split(":")[:2] for hit in name_branches(tmp_path, ("rl", "sft", "dmd2", "rollout-only", "replay"))]
    assert hits == [["miles/x.py", str(n)] for n in range(1, 10)]
