"""Dependencies point inward: the core never imports adapters, launch/ or models/."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "tf_blocksparse"
CORE = ["blocks", "selection", "feedback", "codec", "exchange"]
FORBIDDEN = ("tf_blocksparse.keras", "tf_blocksparse.distribute", "launch", "models", "keras")


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_adapter(module):
    for name in _imports(PKG / f"{module}.py"):
        assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (module, name)


def test_block_table_and_planners_are_tensorflow_free():
    paths = [PKG / "blocks.py", *sorted((PKG / "planning").rglob("*.py"))]
    for path in paths:
        assert not any(n.split(".")[0] in ("tensorflow", "keras") for n in _imports(path)), path
