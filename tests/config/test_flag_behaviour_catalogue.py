"""The flag-behaviour catalogue (tests/flag_tests.toml) against the flag schema (fast, torch-free).

Every flag of `ALL_FLAGS` (the CLI reference plus the miles additions) must name at least one test that
either sets the flag and asserts its effect (`behaviour`) or asserts that a flag/value is refused with a
clear message (`refusal`). This module checks the catalogue mechanically:

  - it has an entry for every flag and none for an unknown one;
  - every test it names exists (the test files are parsed with `ast`, never imported);
  - every named test's *scope* mentions the flag (as `--x-y` or `x_y`), so an entry cannot silently go
    stale when a test is rewritten. A test's scope is its own source (decorators included, so parametrize
    values count), the fixtures it takes (same module, or a conftest.py on its path), the module-level
    helpers / constants it uses (same module, or a sibling helper module it imports from), followed
    transitively, and the shipped recipe YAML of any recipe name it spells (`recipes/NAME.yaml`);
  - the list of flags with neither a behaviour nor a refusal test is empty.

Whether a named test *really* asserts the flag's effect is a human judgement made when the entry is written
(an entry's `note` says why where that is not obvious); tests/config/test_catalog.py only parses flags, so it
may be a flag's behaviour test only with a `note` saying why parsing is all the flag means.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import pytest

from miles.config.catalog import ALL_FLAGS, flag_for
from miles.config.flags import BOOL, TRISTATE, Flag

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
RECIPES = ROOT / "recipes"
CATALOGUE = TESTS / "flag_tests.toml"
KINDS = ("behaviour", "refusal")
ENTRY_KEYS = {*KINDS, "pending", "note"}


# --------------------------------------------------------------------------------------------- catalogue


@dataclass
class Entry:
    flag: str  # the flag's name, without dashes
    tests: dict[str, list[str]] = field(default_factory=dict)  # kind -> node ids
    pending: str = ""  # who is expected to name the test (a reserved flag)
    note: str = ""

    @property
    def covered(self) -> bool:
        return any(self.tests.get(kind) for kind in KINDS)


@cache
def load_catalogue() -> dict[str, Entry]:
    with CATALOGUE.open("rb") as f:
        raw = tomllib.load(f)
    entries: dict[str, Entry] = {}
    for name, body in raw.items():
        assert isinstance(body, dict), f"{CATALOGUE.name}: [{name}] must be a table"
        unknown = set(body) - ENTRY_KEYS
        assert not unknown, (
            f"{CATALOGUE.name}: [{name}] has unknown keys {sorted(unknown)} (allowed: {sorted(ENTRY_KEYS)})"
        )
        tests = {kind: list(body.get(kind, [])) for kind in KINDS}
        entries[name] = Entry(flag=name, tests=tests, pending=body.get("pending", ""), note=body.get("note", ""))
    return entries


def spellings(flag: Flag) -> tuple[str, ...]:
    names = (flag.name, *flag.aliases)
    options = [f"--{name}" for name in names]
    if flag.kind in (BOOL, TRISTATE):
        options.append(flag.negative_option())
    return (*options, *(name.replace("-", "_") for name in names))


def mention_pattern(flag: Flag) -> re.Pattern[str]:
    """`--x-y` (not followed by more of an option name) or `x_y` as a whole identifier."""
    parts = []
    for spelling in spellings(flag):
        if spelling.startswith("--"):
            parts.append(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])")
        else:
            parts.append(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])")
    return re.compile("|".join(parts))


# --------------------------------------------------------------------------------------------- test scopes


@dataclass
class Module:
    path: Path
    source: str
    tree: ast.Module
    defs: dict[str, ast.AST]  # module-level functions, classes and assignments, by name
    imports: dict[str, tuple[str, str]]  # local name -> (sibling helper module, its name) for `from h import x`
    module_imports: dict[str, str]  # local name -> sibling helper module for `import h`

    @cached_property
    def lines(self) -> list[str]:
        return self.source.splitlines()

    def text(self, node: ast.AST) -> str:
        """The source of `node`, decorators included (parametrize values are part of a test)."""
        lines = self.lines
        decorators = getattr(node, "decorator_list", [])
        first = min([node.lineno, *(d.lineno for d in decorators)])
        return "\n".join(lines[first - 1 : node.end_lineno])


@cache
def parse_module(path: Path) -> Module:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    defs: dict[str, ast.AST] = {}
    imports: dict[str, tuple[str, str]] = {}
    module_imports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs[name.id] = node
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if (path.parent / f"{node.module}.py").is_file():
                for alias in node.names:
                    imports[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (path.parent / f"{alias.name}.py").is_file():
                    module_imports[alias.asname or alias.name] = alias.name
    return Module(path, source, tree, defs, imports, module_imports)


def conftests(path: Path) -> list[Path]:
    """The conftest.py files that apply to a test file, nearest first."""
    found = []
    directory = path.parent
    while True:
        candidate = directory / "conftest.py"
        if candidate.is_file():
            found.append(candidate)
        if directory in (TESTS, directory.parent):
            return found
        directory = directory.parent


def is_fixture(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
        if isinstance(target, ast.Name) and target.id == "fixture":
            return True
    return False


def find_test(node_id: str) -> tuple[Module, ast.AST, ast.ClassDef | None] | None:
    """`tests/dir/test_x.py::test_name` or `...::TestClass::test_name` -> (module, function, class)."""
    file_part, _, rest = node_id.partition("::")
    path = ROOT / file_part
    if not rest or not path.is_file():
        return None
    module = parse_module(path)
    names = rest.split("::")
    if len(names) == 1:
        node = module.defs.get(names[0])
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return module, node, None
        return None
    if len(names) == 2:
        cls = module.defs.get(names[0])
        if isinstance(cls, ast.ClassDef):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == names[1]:
                    return module, item, cls
    return None


def _names_in(node: ast.AST) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """(bare names, (name, attribute) pairs, self.attributes) used in `node`."""
    names, attributes, self_attributes = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            attributes.add((sub.value.id, sub.attr))
            if sub.value.id == "self":
                self_attributes.add(sub.attr)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)  # a fixture is requested by argument name
    return names, attributes, self_attributes


@cache
def scope_of(node_id: str) -> str:
    """The text a catalogue entry's test is checked against (see the module docstring)."""
    found = find_test(node_id)
    assert found is not None, node_id
    module, function, cls = found
    pieces: list[str] = []
    seen: set[tuple[Path, str]] = set()
    queue: list[tuple[Module, ast.AST]] = [(module, function)]
    if cls is not None:
        queue.append((module, ast.Module(body=cls.decorator_list, type_ignores=[])))
        for item in cls.body:
            if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                queue.append((module, item))  # class-level constants
    while queue:
        owner, node = queue.pop()
        if isinstance(node, ast.Module):
            pieces.extend(owner.text(decorator) for decorator in node.body)
        else:
            pieces.append(owner.text(node))
        names, attributes, self_attributes = _names_in(node)
        if cls is not None and owner is module:
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name in self_attributes:
                    key = (owner.path, f"{cls.name}.{item.name}")
                    if key not in seen:
                        seen.add(key)
                        queue.append((owner, item))
        for name in names:
            for target_module, target_name in _resolve(owner, name):
                key = (target_module.path, target_name)
                if key not in seen:
                    seen.add(key)
                    queue.append((target_module, target_module.defs[target_name]))
        for base, attr in attributes:
            helper = owner.module_imports.get(base)
            if helper:
                target_module = parse_module(owner.path.parent / f"{helper}.py")
                key = (target_module.path, attr)
                if attr in target_module.defs and key not in seen:
                    seen.add(key)
                    queue.append((target_module, target_module.defs[attr]))
    text = "\n".join(pieces)
    for recipe in recipe_names():
        if re.search(rf"(?<![\w-]){re.escape(recipe)}(?![\w-])", text):
            text += "\n" + (RECIPES / f"{recipe}.yaml").read_text()
    return text


def _resolve(owner: Module, name: str) -> list[tuple[Module, str]]:
    if name in owner.defs:
        return [(owner, name)]
    if name in owner.imports:
        helper, original = owner.imports[name]
        target = parse_module(owner.path.parent / f"{helper}.py")
        return [(target, original)] if original in target.defs else []
    for conftest in conftests(owner.path):
        target = parse_module(conftest)
        if name in target.defs and is_fixture(target.defs[name]):
            return [(target, name)]
    return []


@cache
def recipe_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in RECIPES.glob("*.yaml")))


# --------------------------------------------------------------------------------------------- the checks


def test_catalogue_names_every_flag_and_only_known_ones() -> None:
    entries = load_catalogue()
    missing = [flag.name for flag in ALL_FLAGS if flag.name not in entries]
    unknown = [name for name in entries if flag_for(name) is None or flag_for(name).name != name]
    assert not missing, f"{CATALOGUE.name} has no entry for: " + ", ".join(f"--{name}" for name in missing)
    assert not unknown, f"{CATALOGUE.name} names unknown flags (use the flag's own name): {unknown}"


def test_every_named_test_exists() -> None:
    absent = [
        f"[{entry.flag}] {kind}: {node_id}"
        for entry in load_catalogue().values()
        for kind in KINDS
        for node_id in entry.tests[kind]
        if find_test(node_id) is None
    ]
    assert not absent, "tests named in the catalogue that do not exist:\n  " + "\n  ".join(absent)


def test_every_named_test_mentions_its_flag() -> None:
    stale = []
    for entry in load_catalogue().values():
        flag = flag_for(entry.flag)
        if flag is None:
            continue
        pattern = mention_pattern(flag)
        for kind in KINDS:
            for node_id in entry.tests[kind]:
                if find_test(node_id) is not None and not pattern.search(scope_of(node_id)):
                    stale.append(f"[{entry.flag}] {kind}: {node_id}")
    assert not stale, (
        "catalogue tests whose source (with their fixtures, helpers and recipes) never mentions the flag "
        "(as --x-y or x_y):\n  " + "\n  ".join(stale)
    )


def test_parsing_tests_are_no_behaviour_tests_without_a_note() -> None:
    parsing = "tests/config/test_catalog.py::"
    unjustified = [
        f"[{entry.flag}] {node_id}"
        for entry in load_catalogue().values()
        for node_id in entry.tests["behaviour"]
        if node_id.startswith(parsing) and not entry.note
    ]
    assert not unjustified, (
        "parsing tests named as behaviour tests without a note saying why parsing is all the flag means:\n  "
        + "\n  ".join(unjustified)
    )


def test_no_flag_without_a_behaviour_or_refusal_test() -> None:
    entries = load_catalogue()
    uncovered = [entries[flag.name] for flag in ALL_FLAGS if flag.name in entries and not entries[flag.name].covered]
    lines = [
        f"--{entry.flag}"
        + (f"  (pending: {entry.pending})" if entry.pending else f"  ({entry.note})" if entry.note else "")
        for entry in uncovered
    ]
    counts = {kind: sum(bool(entry.tests[kind]) for entry in entries.values()) for kind in KINDS}
    print(
        f"flag catalogue: {len(entries)} flags, {counts['behaviour']} with a behaviour test, "
        f"{counts['refusal']} with a refusal test, {len(uncovered)} with neither"
    )
    assert not lines, f"{len(lines)} flags with neither a behaviour nor a refusal test:\n  " + "\n  ".join(lines)


@pytest.mark.parametrize("flag", ["lr", "train-only", "colocate"])
def test_mention_pattern_spellings(flag: str) -> None:
    pattern = mention_pattern(flag_for(flag))
    dest = flag.replace("-", "_")
    assert pattern.search(f'cli = {{"{dest}": 1}}') and pattern.search(f"--{flag} 3")
    assert not pattern.search(f"--{flag}-extra 3") and not pattern.search(f"{dest}_extra = 1")


def test_a_scope_follows_parametrize_fixtures_helpers_and_recipes(tmp_path: Path) -> None:
    """The scope machinery itself, on a throw-away test module (never imported)."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef job():\n    return {'diffusion_kl_beta': 0.1}\n"
    )
    (tmp_path / "my_helpers.py").write_text("LIMIT = {'clip_grad': 1.0}\n\ndef build():\n    return LIMIT\n")
    (tmp_path / "test_sample.py").write_text(
        "import pytest\nfrom my_helpers import build\n\n"
        "WEIGHTS = {'lora_rank': 4}\n\n"
        "def local():\n    return WEIGHTS\n\n"
        "@pytest.mark.parametrize('dest', ['n_samples_per_prompt'])\n"
        "def test_a(dest, job):\n    build(); local(); run('tiny-digits-sft')\n\n"
        "class TestB:\n    def test_b(self):\n        self.helper()\n\n"
        "    def helper(self):\n        return '--use-ema'\n"
    )
    scope = scope_of(f"{tmp_path}/test_sample.py::test_a")
    for flag in ("n-samples-per-prompt", "diffusion-kl-beta", "clip-grad", "lora-rank", "diffusion-generator-device"):
        assert mention_pattern(flag_for(flag)).search(scope), flag  # the last: in the tiny-digits-sft recipe
    assert not mention_pattern(flag_for("use-ema")).search(scope)
    assert mention_pattern(flag_for("use-ema")).search(scope_of(f"{tmp_path}/test_sample.py::TestB::test_b"))
    assert find_test(f"{tmp_path}/test_sample.py::test_missing") is None
