"""The documentation: the generated CLI reference matches the schema, every page is in the site's nav, and every
command the README and the getting-started page show resolves (`inspect-config`: its flags are valid and its
recipe exists). The site itself is built with `mkdocs build --strict` in `.ci/run`."""

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
JOB_COMMANDS = ("train", "eval", "rollout-only")


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
    """Every `miles <job> ...` line in a bash block of the README and the getting-started page."""
    found = []
    for path in (ROOT / "README.md", DOCS / "getting-started.md"):
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                for part in (p.strip() for p in line.split("&&")):
                    words = shlex.split(part) if part.startswith("miles ") else []
                    if len(words) > 1 and words[1] in JOB_COMMANDS:
                        found.append((path.name, words))
    return found


def test_the_shown_commands_are_found() -> None:
    commands = [" ".join(words[:3]) for _, words in shown_commands()]
    assert "miles train sft" in commands and "miles train rl" in commands and "miles eval --recipe" in commands


@pytest.mark.parametrize(("page", "words"), shown_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_shown_command_resolves(
    page: str, words: list[str], capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint an earlier command of the page writes (`runs/sft/checkpoint`) stands here as the pipeline's
    model_index.json, which is what the config reads of it."""
    from miles_cli.main import main

    monkeypatch.chdir(tmp_path)
    for i, word in enumerate(words[:-1]):
        if word == "--hf-checkpoint" and words[i + 1].startswith("runs/"):
            folder = tmp_path / words[i + 1]
            folder.mkdir(parents=True)
            (folder / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')

    job, rest = (words[2], words[3:]) if words[1] == "train" else (words[1], words[2:])
    if "--recipe" not in rest:
        pytest.fail(f"{page}: `{' '.join(words)}` names no recipe")
    code = main(["inspect-config", "--job", job, *rest])
    out = capsys.readouterr()
    assert code == 0, f"{page}: `{' '.join(words)}` does not resolve: {out.err[-500:]}"
    assert f"miles {'train ' + job if words[1] == 'train' else job} (recipe " in out.out


def test_version(capsys: pytest.CaptureFixture) -> None:
    from miles import __version__
    from miles_cli.main import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"miles {__version__}"
