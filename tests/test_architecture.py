"""Architecture rules of the whole package, checked on the source.

The package is a compression core, TensorFlow-free planners, and runtimes over the core: the
strategy adapters (``distribute/``), the products that carry their own planner and runtime
(``fusion/``, ``pipeline/``, ``hybrid/``), the step-based trainers' shared ``runtime/``, the
Keras integration (``keras/``, ``auto/``), the notebooks' ``extras/`` and the launcher.

- Planners are TensorFlow-free wherever they live.  A *planner* is every module of
  ``planning/`` and every module that ``tf_blocksparse.planning`` (the planners' public names)
  or a product package's ``__init__`` (``tf_blocksparse.fusion``, ``tf_blocksparse.pipeline``,
  ``tf_blocksparse.hybrid``) loads: it imports no TensorFlow, Keras, repository script or
  non-planner module of the package (checked on the source, and in a fresh interpreter).
- Dependencies point inward: every module imports its own layer and lower ones only
  (:data:`LAYERS`), with no exception; core modules (``tf_blocksparse/*.py``) import only the
  core and the planners, and no Keras.
- The runtimes (``distribute/``, ``runtime/`` and the products' runtimes) do not import the
  Keras integration (``tf_blocksparse.keras``, ``tf_blocksparse.auto``): the exchange shells
  share the core's hooks, not the optimizer wrapper's code.
- No module of the package imports the repository's ``launch/`` or ``models/``, and none but
  its own imports ``extras/`` (the notebooks' helpers).
- The package's import graph (imports inside functions included) has no cycle.
- Private TensorFlow / Keras APIs (``keras.src``, ``tf.__internal__``, ``tensorflow.python``,
  underscore attributes of other objects) are used only in ``tf_blocksparse/_compat.py``.
- The repository's scripts (``launch/``) do not import ``tf_blocksparse._compat``: what they
  need of it the library offers as a public function.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from tests.versions import reads_keras_315_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "tf_blocksparse"
REPO_ONLY = ("launch", "models")
COMPAT = PKG / "_compat.py"
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl", "tensorflow.core")
#: The packages whose import is TensorFlow-free: the planners' public names and each product's
#: planner (a product package's ``__init__`` imports its planner only, never its runtime).
PLANNER_ROOTS = ("tf_blocksparse.planning", "tf_blocksparse.fusion", "tf_blocksparse.pipeline",
                 "tf_blocksparse.hybrid")
#: The Keras integration, which no runtime imports.
KERAS_INTEGRATION = ("tf_blocksparse.keras", "tf_blocksparse.auto")


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every ``tf_blocksparse`` module -> the package's modules it imports anywhere in its
    source (at the top, inside functions or under ``if``): ``from package import module``
    counts as importing the module, a relative import is resolved."""
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in paths else base)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _planners(graph: dict[str, set[str]]) -> set[str]:
    """The planner modules: every module of ``planning/`` and what :data:`PLANNER_ROOTS` load,
    however indirectly."""
    found: set[str] = set()
    todo = [m for m in graph if _under(m, ("tf_blocksparse.planning",))] + list(PLANNER_ROOTS)
    while todo:
        module = todo.pop()
        if module not in found:
            found.add(module)
            todo.extend(graph[module])
    return found


GRAPH = _import_graph()
PLANNERS = _planners(GRAPH)
PATHS = {_module_name(p): p for p in PKG.rglob("*.py")}


def _files(modules) -> list[pathlib.Path]:
    return sorted(PATHS[m] for m in modules)


CORE = sorted(p for p in PKG.glob("*.py") if p.name not in ("__init__.py", "_compat.py"))
#: The runtimes over the core: the strategy adapters, the shared trainer runtime and every
#: module of a product package that is not its planner.
RUNTIMES = sorted(m for m in GRAPH if m not in PLANNERS and _under(m, (
    "tf_blocksparse.distribute", "tf_blocksparse.runtime", "tf_blocksparse.fusion",
    "tf_blocksparse.pipeline", "tf_blocksparse.hybrid")))
REPO_PY = sorted(p for d in ("tf_blocksparse", "launch", "models")
                 for p in (ROOT / d).rglob("*.py"))


def test_the_planners_are_found():
    """Each product's planner is a planner and its runtime is not (the checks below see
    them)."""
    for module in ("planning.scaling", "planning.projection", "planning.link_cost", "fusion",
                   "fusion.balanced", "pipeline", "pipeline.partition", "pipeline.profile",
                   "pipeline.topology", "hybrid", "hybrid.planner", "hybrid.memory"):
        assert f"tf_blocksparse.{module}" in PLANNERS, module
    for module in ("fusion.forward_order", "pipeline.profiler", "pipeline.trainer",
                   "pipeline.stages", "hybrid.split", "hybrid.sync", "hybrid.trainer",
                   "hybrid.inspection"):
        assert f"tf_blocksparse.{module}" in RUNTIMES, module


@pytest.mark.parametrize("path", CORE, ids=_rel)
def test_core_imports_only_the_core_and_the_planners(path):
    bad = {n for n in _imports(path) if _under(n, (*REPO_ONLY, "keras"))}
    bad |= {m for m in GRAPH[_module_name(path)]
            if _group(m) not in ("core", "compat", "kernels", "planners")}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


def test_block_rule_table_and_options_are_tensorflow_free():
    for name in ("blocks.py", "options.py"):
        bad = {n for n in _imports(PKG / name) if _under(n, ("tensorflow", "keras"))}
        assert not bad, f"tf_blocksparse/{name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _files(PLANNERS), ids=_rel)
def test_planners_are_tensorflow_free(path):
    bad = {n for n in _imports(path) if _under(n, ("tensorflow", "keras", *REPO_ONLY))}
    bad |= {m for m in GRAPH[_module_name(path)] if m not in PLANNERS}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _files(RUNTIMES), ids=_rel)
def test_runtimes_import_no_keras_integration(path):
    bad = {m for m in GRAPH[_module_name(path)] if _under(m, KERAS_INTEGRATION)}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=_rel)
def test_the_package_imports_no_repository_scripts(path):
    bad = {n for n in _imports(path) if _under(n, REPO_ONLY)}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


def test_no_module_imports_the_notebooks_extras():
    """``extras/`` (the run-length codec the notebooks compare) is outside the exchange."""
    bad = {m for m, targets in GRAPH.items() if not _under(m, ("tf_blocksparse.extras",))
           and any(_under(t, ("tf_blocksparse.extras",)) for t in targets)}
    assert not bad, sorted(bad)


def test_importing_the_planners_loads_no_tensorflow():
    code = ("import sys, tf_blocksparse.planning as p; p.plan_backward; "
            + "".join(f"import {m}; " for m in PLANNER_ROOTS)
            + "bad = [m for m in ('tensorflow', 'keras') if m in sys.modules]; "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@reads_keras_315_files
def test_bare_import_then_keras_loads_a_saved_optimizer():
    """``import tf_blocksparse`` is enough for Keras to load a ``.keras`` file that uses the
    optimizer, whichever of the two is imported first."""
    path = ROOT / "tests" / "data" / "model_v0_1_0.keras"
    load = (f"m = keras.saving.load_model({str(path)!r}); "
            "assert type(m.optimizer).__name__ == 'BlockSparseOptimizer'")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    for first in ("import tf_blocksparse, sys; assert 'tensorflow' not in sys.modules; "
                  "import keras", "import keras, tf_blocksparse"):
        proc = subprocess.run([sys.executable, "-c", f"{first}; {load}"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (first, proc.stderr[-2000:])


@pytest.mark.parametrize("first", [
    "import tf_blocksparse as tfbs; tfbs.BlockSparseOptimizer",
    "import tf_blocksparse.keras.momentum",
], ids=["optimizer_attribute", "keras_submodule"])
def test_keras_imported_by_the_package_registers_without_warning(first):
    """A tf_blocksparse module that imports Keras itself registers the optimizer once its
    own import is done: no circular-import warning, and Keras finds the class."""
    check = ("import keras, sys; "
             "o = keras.saving.get_registered_object('tf_blocksparse>BlockSparseOptimizer'); "
             "assert o is sys.modules['tf_blocksparse.keras.optimizer'].BlockSparseOptimizer")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-W", "always", "-c", f"{first}; {check}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "could not register" not in proc.stderr and "circular" not in proc.stderr, \
        proc.stderr[-2000:]


#: Run in a fresh process: every Keras / TensorFlow class of the modules below, as the names in
#: its ``__dict__`` and the objects they hold, before and after importing every module of the
#: package and fitting a wrapped model; then once more after a deliberate change (the check
#: must see it).  A class's ``__annotations__`` is left out: Python creates it when first read.
_UNTOUCHED = """
import importlib, inspect, pkgutil, warnings
import keras, numpy as np, tensorflow as tf
mods = [keras, keras.callbacks, keras.optimizers, keras.layers, keras.losses, keras.metrics,
        keras.saving, keras.mixed_precision, tf.distribute, tf.distribute.experimental,
        keras.src.callbacks.callback_list, keras.src.optimizers.base_optimizer]
def snap():
    return {f"{m.__name__}.{n}.{k}": id(v) for m in mods for n, c in vars(m).items()
            if inspect.isclass(c) for k, v in vars(c).items()
            if k != "__annotations__"}  # created when first read
before = snap()
import tf_blocksparse as tfbs
for info in pkgutil.walk_packages(tfbs.__path__, "tf_blocksparse."):
    if ".kernels.build" not in info.name:
        importlib.import_module(info.name)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), dense_steps=1, sync_every=2)
model.compile(opt, "mse")
x = np.zeros((8, 4), "float32")
model.fit(x, np.zeros((8, 2), "float32"), batch_size=4, verbose=0,
          callbacks=tfbs.fit_callbacks(model))
after = snap()
print("CHANGED", sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)))
keras.callbacks.CallbackList.__init__ = lambda self, *a, **k: None
print("DETECTED", [k for k in snap() if snap()[k] != after.get(k)])
"""


def test_no_keras_or_tensorflow_class_is_changed():
    """Importing the package and training with it leave every Keras and TensorFlow class as
    it was (no method replaced, no attribute added); the check sees a replaced method."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-c", _UNTOUCHED], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines()
                 if line.startswith(("CHANGED", "DETECTED")))
    assert lines["CHANGED"] == "[]", lines["CHANGED"]
    assert "keras.callbacks.CallbackList.__init__" in lines["DETECTED"]


def _project_names(tree: ast.AST) -> set[str]:
    """Names a file binds to the repository's own modules (their private names are the
    project's business, not a TensorFlow / Keras API)."""
    names = {"os"}  # os._exit is documented
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or _under(
                node.module or "", ("tf_blocksparse", *REPO_ONLY))):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names
                         if _under(a.name, ("tf_blocksparse", *REPO_ONLY)))
    return names


def _private_uses(path: pathlib.Path) -> list[str]:
    """``keras.src`` / ``tensorflow.python`` imports, ``tf.__internal__`` and underscore
    attributes read from anything but ``self``, ``cls``, ``super()`` or the project's own
    modules."""
    tree = ast.parse(path.read_text())
    own = _project_names(tree)
    found = [f"import {n}" for n in _imports(path) if _under(n, PRIVATE_MODULES)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if name == "src" and isinstance(node.value, ast.Name) and node.value.id == "keras":
                found.append(f"line {node.lineno}: keras.src")
                continue
            if name == "__internal__" or (name.startswith("_") and not name.startswith("__")):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls", *own):
                    continue
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                    continue
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "getattr", "hasattr", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_") \
                and not str(node.args[1].value).startswith("__"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", [p for p in REPO_PY if p != COMPAT], ids=_rel)
def test_private_apis_only_through_compat(path):
    found = _private_uses(path)
    assert not found, f"{_rel(path)} uses private APIs outside tf_blocksparse._compat: {found}"


def test_the_private_api_check_can_fail():
    assert _private_uses(COMPAT), "the check finds nothing even in _compat"


COMPAT_MODULE = "tf_blocksparse._compat"
LAUNCH_PY = sorted((ROOT / "launch").rglob("*.py"))


def _compat_imports(tree: ast.AST) -> list[str]:
    """The statements of ``tree`` (anywhere, functions included) that import the private
    hooks: ``import tf_blocksparse._compat``, ``from tf_blocksparse import _compat`` or
    ``from tf_blocksparse._compat import ...`` (a relative import counts only inside the
    package, which the scripts are not)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if _under(a.name, (COMPAT_MODULE,))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            if _under(node.module, (COMPAT_MODULE,)) or any(
                    _under(n, (COMPAT_MODULE,)) for n in names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", LAUNCH_PY, ids=_rel)
def test_launch_scripts_do_not_import_compat(path):
    found = _compat_imports(ast.parse(path.read_text()))
    assert not found, f"{_rel(path)} imports {COMPAT_MODULE} (use a public function): {found}"


def test_the_compat_import_check_can_fail():
    sources = ["from tf_blocksparse import _compat", "import tf_blocksparse._compat as c",
               "def f():\n    from tf_blocksparse._compat import resumed_epoch"]
    assert all(_compat_imports(ast.parse(src)) for src in sources)
    assert not _compat_imports(ast.parse("from tf_blocksparse import timing, compat_x"))


def test_the_package_has_no_import_cycle():
    """No module of ``tf_blocksparse`` imports, however indirectly, one that imports it back;
    imports inside functions count (they would only hide a cycle)."""
    graph = _import_graph()
    assert "tf_blocksparse.keras.optimizer" in graph["tf_blocksparse.keras.callbacks"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        " / ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles)


def test_the_cycle_check_can_fail():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


#: The package's layers, lowest first: a module may import its own layer and lower ones.
LAYERS = (
    ("planners",),                          # TensorFlow-free planners, wherever they live
    ("core", "compat", "kernels"),          # the compression core over collectives
    ("distribute", "fusion", "runtime",     # strategy adapters, the fusion runtime, the
     "extras"),                             # step-based trainers' shared runtime, the
                                            # notebooks' helpers
    ("pipeline", "hybrid"),                 # the pipeline and hybrid runtimes
    ("auto", "keras"),                      # the Keras integration
    ("launcher",),                          # the process launcher (standard library)
)
FOLDERS = ("kernels", "distribute", "fusion", "runtime", "extras", "pipeline", "hybrid", "auto",
           "keras", "launcher")


def _group(module: str) -> str | None:
    """The layer group of a ``tf_blocksparse`` module (``None``: the package's ``__init__``,
    which re-exports every layer)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if module in PLANNERS:
        return "planners"
    if parts[1] in FOLDERS:
        return parts[1]
    return "compat" if parts[1] == "_compat" else "core"


def _layer(group: str) -> int:
    return next(i for i, groups in enumerate(LAYERS) if group in groups)


def _upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for a, targets in graph.items():
        for b in targets:
            ga, gb = _group(a), _group(b)
            if ga is not None and gb is not None and _layer(gb) > _layer(ga):
                out.add((a.split(".", 1)[1], b.split(".", 1)[1]))
    return out


def test_imports_follow_the_layer_order():
    """No module imports a higher layer (docs/architecture.md), with no exception."""
    upward = _upward_imports(GRAPH)
    assert upward == set(), sorted(upward)


def test_the_layer_check_can_fail():
    graph = {"tf_blocksparse.exchange": {"tf_blocksparse.keras.optimizer"},
             "tf_blocksparse.keras.optimizer": {"tf_blocksparse.exchange"},
             "tf_blocksparse.fusion.plan": {"tf_blocksparse.fusion.forward_order"}}
    assert _upward_imports(graph) == {("exchange", "keras.optimizer"),
                                      ("fusion.plan", "fusion.forward_order")}
