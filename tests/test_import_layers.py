"""The package layers import downwards only: models < rollout < training < runtime.

Every import counts, including the ones inside functions (a lazy import is still a dependency), so
the graph between these four has no circle. What a lower layer needs from a higher one it names by
dotted path (like `TEACHER_BUILDER`), resolved at run time.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

MILES = Path(__file__).resolve().parents[1] / "miles"
ORDER = ("models", "rollout", "training", "runtime")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def upward_imports(layer: str, root: Path = MILES) -> list[str]:
    higher = ORDER[ORDER.index(layer) + 1 :]
    bad = []
    for path in sorted((root / layer).rglob("*.py")):
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] == "miles" and len(parts) > 1 and parts[1] in higher:
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", ORDER[:-1])
def test_layers_import_downwards_only(layer):
    assert upward_imports(layer) == []


def test_the_check_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "miles" / "models"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from miles.training.trainer import Trainer\n    return Trainer\n")
    assert upward_imports("models", tmp_path / "miles") == ["miles/models/x.py:2 imports miles.training.trainer"]


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
