"""``pccheck/native/_native.pyi`` names exactly what the built core exports: every module-level
name and every public method and property of its classes, no more and no fewer."""

from __future__ import annotations

import ast
from pathlib import Path

from pccheck.native import _native


def _stub() -> tuple[set[str], dict[str, set[str]]]:
    path = Path(_native.__file__).with_name("_native.pyi")
    tree = ast.parse(path.read_text())
    names, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return names, classes


def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_stub_matches_the_built_module():
    names, classes = _stub()
    assert names == _public(_native)
    for cls, methods in classes.items():
        have = _public(getattr(_native, cls))
        assert methods - {"__init__"} == have, cls
