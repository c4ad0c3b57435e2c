"""The package layers import downwards only: models < rollout < training < runtime.

Every import counts, including the ones inside functions (a lazy import is still a dependency), so
the graph between these four has no circle. What a lower layer needs from a higher one it names by
dotted path (like `TEACHER_BUILDER`), resolved at run time.
"""

from __future__ import annotations

import ast
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
