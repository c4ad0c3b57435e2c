"""Every package of miles/ sits on one floor and imports only the floors below it and itself; no module imports
itself back through others.

Every import counts, including the ones inside functions (a lazy import is still a dependency); only the
imports under `if TYPE_CHECKING:` (annotations) do not. What a lower floor needs from a higher one it names by
dotted path (like `miles.core.inputs.ENSURE_INPUT` or the method table's `impl`), resolved at run time.

The floors, lowest first (the root module `miles/methods.py`, the method table, and the face of the rewards,
`miles/rewards/__init__.py`, the reward table, sit on the ground floor):

    core < utils < io < data < models < sampling < algorithms < placement < config < rewards < rollout < training
    < builtin < memory < preflight < runtime

The sampling math (`sampling/`: the denoising grid, the step strategies, the SDE and ODE steps) sits just above the
models, below the config (its rules warn about the trained steps before anything starts, torch-free) and below the
algorithms (the training formulas read its sigma shift), which sit below everything that runs: they import no
rollout, config or trainer.

A torch-free table may sit below its package (`MODULE_FLOORS`): `builtin/names.py`, the catalogue of the embedded
default, is on the floor of utils, so the config's rules, the models' metadata and the denoising grid may read the
built-in names. The one dotted-path loader, `utils/dotted.py` (it imports nothing of miles), is on the floor of core,
which resolves `ENSURE_INPUT` with it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

MILES = Path(__file__).resolve().parents[1] / "miles"
ORDER = (
    "core",
    "utils",
    "io",
    "data",
    "models",
    "sampling",
    "algorithms",
    "placement",
    "config",
    "rewards",
    "rollout",
    "training",
    "builtin",
    "memory",
    "preflight",
    "runtime",
)
GROUND_MODULES = ("methods",)  # miles/<name>.py: on the floor of core: the method table
# packages whose face (`__init__.py` and the names it defines, a torch-free table) sits on the floor of core, below
# the rest of the package: the reward table; `miles.rewards.dispatch` and the rest are on the floor of rewards
GROUND_FACES = ("rewards",)
# package.module -> the floor it sits on, below its package's (a table the lower floors read)
MODULE_FLOORS = {
    "builtin.names": "utils",
    "utils.dotted": "core",
}


def _floor(name: str) -> int:
    return 0 if name in GROUND_MODULES else ORDER.index(name)


def _in_type_checking(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _in_type_checking(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _package(path: Path, root: Path) -> str:
    return path.relative_to(root).parts[0].removesuffix(".py")


def _is_submodule(package: Path, name: str) -> bool:
    return name != "__init__" and ((package / name).is_dir() or (package / f"{name}.py").is_file())


def _module_floor(parts: list[str], root: Path = MILES) -> int | None:
    """The floor of `miles.<package>.<module>...` when it sits below its package: MODULE_FLOORS places it there, or
    it is the face of a GROUND_FACES package (`miles.rewards`, `miles.rewards.REWARD_TYPES`, not a submodule)."""
    face = len(parts) >= 2 and parts[1] in GROUND_FACES
    if face and (len(parts) == 2 or not _is_submodule(root / parts[1], parts[2])):
        return 0
    own = MODULE_FLOORS.get(".".join(parts[1:3]))
    return None if own is None else _floor(own)


def upward_imports(layer: str, root: Path = MILES) -> list[str]:
    bad = []
    paths = [root / f"{layer}.py"] if layer in GROUND_MODULES else sorted((root / layer).rglob("*.py"))
    for path in paths:
        mine = _module_floor(["miles", *path.relative_to(root).with_suffix("").parts], root)
        floor = _floor(layer) if mine is None else mine
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] != "miles" or len(parts) < 2 or (parts[1] == layer and mine is None):
                continue
            target = parts[1]
            theirs = _module_floor(parts, root)
            if theirs is not None:
                if theirs > floor:
                    bad.append(f"{path.relative_to(root.parent)}:{line} imports {'.'.join(parts[:3])}")
                continue
            if (target in ORDER or target in GROUND_MODULES) and _floor(target) > floor:
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {'.'.join(parts[:2])}")
            elif target not in ORDER and target not in GROUND_MODULES and (root / target).is_dir():
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {target}, which has no floor")
    return sorted(set(bad))


def test_every_package_has_a_floor() -> None:
    packages = {p.name for p in MILES.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in MILES.glob("*.py")} - {"__init__"}
    assert packages == set(ORDER)
    assert modules == set(GROUND_MODULES)


@pytest.mark.parametrize("layer", ORDER + GROUND_MODULES)
def test_layers_import_downwards_only(layer):
    assert upward_imports(layer) == []


def test_the_check_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "miles" / "models"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from miles.training.trainer import Trainer\n    return Trainer\n")
    assert upward_imports("models", tmp_path / "miles") == ["miles/models/x.py:2 imports miles.training"]


def test_a_table_below_its_package_is_checked_on_its_own_floor(tmp_path: Path) -> None:
    root = tmp_path / "miles"
    for package in ("builtin", "data"):
        (root / package).mkdir(parents=True)
    (root / "builtin" / "names.py").write_text("from miles.utils.paths import data_dir\nfrom miles.models import x\n")
    (root / "data" / "d.py").write_text("from miles.builtin.names import N\nfrom miles.builtin.checkpoints import e\n")
    assert upward_imports("builtin", root) == ["miles/builtin/names.py:2 imports miles.models"]
    assert upward_imports("data", root) == ["miles/data/d.py:2 imports miles.builtin"]


def test_a_ground_face_is_checked_on_the_ground_floor(tmp_path: Path) -> None:
    root = tmp_path / "miles"
    for package in ("rewards", "config"):
        (root / package).mkdir(parents=True)
    (root / "rewards" / "__init__.py").write_text(
        "from miles.core.errors import E\nfrom miles.rewards.dispatch import f\n"
    )
    (root / "rewards" / "dispatch.py").write_text("from miles.config.catalog import F\nfrom miles.rollout import x\n")
    (root / "config" / "c.py").write_text(
        "from miles.rewards import REWARD_TYPES\nfrom miles.rewards import dispatch\n"
    )
    assert upward_imports("rewards", root) == [
        "miles/rewards/__init__.py:2 imports miles.rewards",
        "miles/rewards/dispatch.py:2 imports miles.rollout",
    ]
    assert upward_imports("config", root) == ["miles/config/c.py:2 imports miles.rewards"]


def module_graph(root: Path = MILES) -> dict[str, set[str]]:
    """module -> the modules of miles it imports (a `from pkg import name` counts `pkg.name` when that is one)."""

    def name_of(path: Path) -> str:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name_of(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        out = set()
        for _, imported in _imports(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != module:
                out.add(imported)
        graph[module] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back() -> None:
    assert circles(module_graph()) == []


def test_the_circle_check_finds_a_lazy_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "miles" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from miles.training.b import g\nfrom miles.training import c\n")
    (pkg / "b.py").write_text("def g():\n    from miles.training import a\n    return a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles.training.a import x\n"
    )
    assert circles(module_graph(tmp_path / "miles")) == [["miles.training.a", "miles.training.b"]]


def test_the_preflight_imports_no_runtime() -> None:
    """The preflight runs before the runtime: it may read every layer but that one."""
    bad = [
        f"{path.relative_to(MILES.parent)}:{line} imports {module}"
        for path in sorted((MILES / "preflight").rglob("*.py"))
        for line, module in _imports(path)
        if module == "miles.runtime" or module.startswith("miles.runtime.")
    ]
    assert bad == []


def test_the_preflight_of_a_tiny_recipe_imports_neither_torch_nor_ray(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from miles.config.resolve import resolve\n"
        "from miles.preflight import find_problems\n"
        "for recipe in ('tiny-digits-grpo', 'tiny-digits-sft', 'tiny-digits-4step'):\n"
        "    assert find_problems(resolve(None, recipe=recipe)) == [], recipe\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(MILES.parent), "MILES_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MILES_DIFFUSION_MODEL_FAMILY", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("HEAVY=")
