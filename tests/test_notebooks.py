"""The Colab notebooks in ``colab/``.

Fast checks (run by ``make test``): the committed notebooks carry no outputs, match their
generator (``colab/build_notebooks.py``) and are linked from the README with a Colab badge; their
install cell stops with a clear error when pip fails (run with sources pip rejects at once, and
with ``PIP_DRY_RUN`` set, so nothing is ever installed).

``test_notebook_runs`` (marked ``notebooks``, run by ``make test-notebooks``) executes every
notebook top to bottom with nbclient in a fresh kernel of this interpreter (the venv's), in a
temporary working directory; a cell that raises fails the test.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart", "compression_anatomy", "pipeline_planner", "hybrid_placement")
CELL_TIMEOUT_S = 300


def _load_generator():
    spec = importlib.util.spec_from_file_location("build_notebooks", COLAB / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_committed():
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_no_outputs(name):
    nb = json.loads((COLAB / f"{name}.ipynb").read_text())
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    for cell in code:
        assert cell["outputs"] == [], f"cell {cell.get('id')} has outputs"
        assert cell["execution_count"] is None, f"cell {cell.get('id')} has an execution count"
    assert "widgets" not in nb["metadata"]


def _install_cell(name: str) -> str:
    nb = json.loads((COLAB / f"{name}.ipynb").read_text())
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_starts_with_the_install_cell(name):
    source = _install_cell(name)
    assert source == _install_cell(NOTEBOOKS[0])
    assert 'find_spec("tf_blocksparse") is None' in source
    assert "subprocess.check_call([sys.executable, \"-m\", \"pip\", \"install\"" in source
    assert "%pip" not in source and "!pip" not in source  # a failed magic does not stop Run all


def _run_install_cell(cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs the install cell as a script; pip never installs anything (``PIP_DRY_RUN``)."""
    env = {**os.environ, "PIP_DRY_RUN": "1", "PIP_NO_INDEX": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           **env}
    return subprocess.run([sys.executable, "-c", _install_cell(NOTEBOOKS[0])], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_install_cell_stops_with_a_clear_error_when_pip_fails(tmp_path):
    missing = tmp_path / "no_such_checkout"
    proc = _run_install_cell(tmp_path, TFBS_SOURCE=str(missing), TFBS_FORCE_INSTALL="1")
    assert proc.returncode != 0
    assert f"pip could not install tf_blocksparse from '{missing}'" in proc.stderr, proc.stderr
    assert "TFBS_SOURCE" in proc.stderr.splitlines()[-1]


def test_install_cell_installs_the_checkout_it_runs_in(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "tf_blocksparse").mkdir(parents=True)
    (checkout / "colab").mkdir()
    (checkout / "pyproject.toml").write_text("[project\n")  # pip rejects it before building
    proc = _run_install_cell(checkout / "colab", TFBS_FORCE_INSTALL="1")
    assert proc.returncode != 0
    assert f"installing tf_blocksparse from {checkout} ..." in proc.stdout, proc.stdout
    assert f"pip could not install tf_blocksparse from '{checkout}'" in proc.stderr


def test_install_cell_sees_which_loaded_packages_pip_would_replace():
    """The helper that tells a session to restart after pip replaced a module it had loaded."""
    tree = ast.parse(_install_cell(NOTEBOOKS[0]))
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom,
                                                         ast.FunctionDef))
                 and not (isinstance(n, ast.Import) and n.names[0].name == "tf_blocksparse")]
    helpers: dict = {}
    exec(compile(tree, "install cell", "exec"), helpers)  # its imports and functions only
    import numpy

    loaded = helpers["loaded_distributions"]()
    assert loaded["numpy"] == numpy.__version__
    assert "pytest" in loaded


def test_install_cell_installs_nothing_where_the_package_imports(tmp_path):
    proc = _run_install_cell(tmp_path, PYTHONPATH=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "installing" not in proc.stdout
    assert f"tf_blocksparse from {ROOT / 'tf_blocksparse'}" in proc.stdout


def test_notebooks_match_their_generator():
    pytest.importorskip("nbformat")
    generator = _load_generator()
    assert set(generator.NOTEBOOKS) == set(NOTEBOOKS)
    stale = [name for name in NOTEBOOKS
             if (COLAB / f"{name}.ipynb").read_text() != generator.render(name)]
    assert not stale, f"run `python colab/build_notebooks.py` to regenerate {stale}"


def test_readme_links_every_notebook_with_a_colab_badge():
    readme = (ROOT / "README.md").read_text()
    for name in NOTEBOOKS:
        assert f"blob/main/colab/{name}.ipynb" in readme, f"README does not link {name}"
    assert readme.count("colab-badge.svg") >= len(NOTEBOOKS)
    # the badges, the README's install command and the install cell name one repository
    url = _load_generator().PROJECT_URL
    assert f"git+{url}" in readme
    repo = url.removeprefix("https://github.com/")
    for name in NOTEBOOKS:
        assert f"colab.research.google.com/github/{repo}/blob/main/colab/{name}.ipynb" in readme


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A ``python3`` kernelspec that runs this interpreter, found first on ``JUPYTER_PATH``."""
    pytest.importorskip("ipykernel")
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tf_blocksparse tests)", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(root))
        # the kernel runs in a temporary folder: this checkout's launch/ (the data loaders) and
        # tf_blocksparse come first, as from the repository's root
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT),
                                                             os.environ.get("PYTHONPATH")])))
        mp.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
        mp.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # even if CI set Agg
        mp.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # debugpy's frozen-modules warning
        yield "python3"


@pytest.mark.notebooks
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_name, tmp_path, record_property):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    print(f"{name}: {seconds:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
    assert images >= 1, "no figure was drawn"
