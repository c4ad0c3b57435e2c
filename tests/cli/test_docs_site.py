"""The documentation: the generated CLI reference matches the schema, every page is in the site's nav, and every
command the README and the docs pages show in a bash block resolves (`inspect-config`: its flags are valid and its
recipe exists; `inspect-config` and `plan` lines themselves run as shown). The site itself is built with
`mkdocs build --strict` in `.ci/run`."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from miles.config.catalog import ALL_FLAGS
from miles.config.reference import PAGE, render

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
JOB_COMMANDS = ("train", "eval", "rollout-only", "replay")
CONFIG_COMMANDS = ("inspect-config", "plan")
# the pages whose bash blocks are checked: the README and every docs page but the generated reference
SHOWN_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "reference")]


def test_the_cli_reference_page_is_the_schema() -> None:
    assert PAGE.read_text() == render(), (
        "docs/reference/cli.md is out of date: python -m miles.config.reference --write"
    )
    page = PAGE.read_text()
    for flag in ALL_FLAGS:
        assert f"`{flag.option}`" in page


def test_the_reference_names_the_rules_that_read_a_flag() -> None:
    row = next(line for line in render().splitlines() if line.startswith("| `--reward-weights`"))
    assert "`data.check_reward`" in row and "name=w" not in row.split("|")[2]


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def shown_commands() -> list[tuple[str, list[str]]]:
    """Every `miles <job> ...`, `miles inspect-config ...` and `miles plan ...` line in a bash block of the README
    and the docs pages (a shell redirection ends the command)."""
    found = []
    for path in SHOWN_PAGES:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip()
                for part in (p.strip() for p in line.split("&&")):
                    words = shlex.split(part) if part.startswith("miles ") else []
                    words = words[: words.index(">")] if ">" in words else words
                    if len(words) > 1 and words[1] in JOB_COMMANDS + CONFIG_COMMANDS:
                        found.append((str(path.relative_to(ROOT)), words))
    return found


def test_the_shown_commands_are_found() -> None:
    readme = [" ".join(words[:3]) for page, words in shown_commands() if page == "README.md"]
    assert "miles train sft" in readme and "miles train rl" in readme and "miles eval --recipe" in readme
    assert "miles inspect-config --recipe" in readme
    pages = {page for page, _ in shown_commands()}
    assert {f"docs/jobs/{name}.md" for name in ("train-rl", "train-sft", "train-dmd2", "eval", "replay")} <= pages


def _inspect_args(words: list[str]) -> list[str]:
    """The `inspect-config` arguments that resolve the shown command: a job's flags under its `--job`; an
    `inspect-config` or `plan` line as shown, but for `--check` (the preflight needs the built-in data built)."""
    if words[1] in CONFIG_COMMANDS:
        return [w for w in words[1:] if w != "--check"]
    if words[1] == "replay":  # miles replay ROLLOUT.pt FLAGS: the file is --load-debug-rollout-data
        return ["inspect-config", "--job", "replay", "--load-debug-rollout-data", words[2], *words[3:]]
    job, rest = (words[2], words[3:]) if words[1] == "train" else (words[1], words[2:])
    return ["inspect-config", "--job", job, *rest]


@pytest.mark.parametrize(("page", "words"), shown_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_shown_command_resolves(
    page: str, words: list[str], capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint an earlier command of the page writes (`runs/sft/checkpoint`) stands here as the pipeline's
    model_index.json, which is what the config reads of it."""
    from miles_cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for i, word in enumerate(words[:-1]):
        if word == "--hf-checkpoint" and words[i + 1].startswith("runs/"):
            folder = tmp_path / words[i + 1]
            folder.mkdir(parents=True)
            (folder / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')

    if "--recipe" not in words:
        pytest.fail(f"{page}: `{' '.join(words)}` names no recipe")
    code = main(_inspect_args(words))
    out = capsys.readouterr()
    assert code == 0, f"{page}: `{' '.join(words)}` does not resolve: {out.err[-500:]}"
    if words[1] in JOB_COMMANDS:
        assert f"miles {'train ' + words[2] if words[1] == 'train' else words[1]} (recipe " in out.out


def test_version(capsys: pytest.CaptureFixture) -> None:
    from miles import __version__
    from miles_cli.main import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"miles {__version__}"
