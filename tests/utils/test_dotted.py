"""`miles.utils.dotted`: the one dotted-path loader (`pkg.mod.attr`, `pkg.mod:attr`, nested attributes) and what it
reports when a path does not load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.utils.dotted import (
    AttributeLookupError,
    DottedPathError,
    ModuleImportError,
    import_dotted,
    load_dotted,
)


@pytest.fixture()
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "dq_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "mod.py").write_text("def fn():\n    pass\n\n\nclass C:\n    def meth(self):\n        pass\n")
    (pkg / "needs_dep.py").write_text("import dq_missing_dependency\n")
    (pkg / "prefix_dep.py").write_text("import dq_pk\n")  # a missing name that is a string prefix of the package's
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("dq_")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    "path, qualname",
    [
        ("dq_pkg.mod.fn", "fn"),
        ("dq_pkg.mod:fn", "fn"),
        ("dq_pkg.mod.C.meth", "C.meth"),
        ("dq_pkg.mod:C.meth", "C.meth"),
        ("collections.abc.Mapping", "Mapping"),
    ],
)
def test_both_forms_and_nested_attributes_load(tree: Path, path: str, qualname: str) -> None:
    assert load_dotted(path).__qualname__ == qualname
    assert import_dotted(path) is load_dotted(path)


def test_a_missing_dependency_inside_the_module_is_not_taken_for_no_such_module(tree: Path) -> None:
    for path in ("dq_pkg.needs_dep.fn", "dq_pkg.needs_dep:fn", "dq_pkg.needs_dep.fn.x"):
        with pytest.raises(ModuleImportError) as info:
            load_dotted(path)
        assert info.value.module == "dq_pkg.needs_dep" and info.value.found
        assert isinstance(info.value.__cause__, ModuleNotFoundError)
        with pytest.raises(ModuleNotFoundError, match="dq_missing_dependency"):
            import_dotted(path)
    with pytest.raises(ModuleNotFoundError, match="'dq_pk'"):
        import_dotted("dq_pkg.prefix_dep.fn")


def test_what_does_not_load_is_named(tree: Path) -> None:
    with pytest.raises(ModuleImportError) as info:
        load_dotted("dq_nothing.mod.fn")
    assert (info.value.module, info.value.found) == ("dq_nothing.mod", False)
    with pytest.raises(ImportError, match=r"expected a dotted path 'package\.module\.attr'"):
        import_dotted("dq_nothing.mod.fn")
    with pytest.raises(AttributeLookupError) as attr:
        load_dotted("dq_pkg.mod.C.nope")
    assert (attr.value.walked, attr.value.attr) == ("dq_pkg.mod.C", "nope")
    with pytest.raises(AttributeError, match="type object 'C' has no attribute 'nope'"):
        import_dotted("dq_pkg.mod.C.nope")
    for bad in ("dq_pkg", "dq_pkg..mod", "dq_pkg.mod:", ":fn"):
        with pytest.raises(DottedPathError):
            load_dotted(bad)
