"""The installable package is the library alone, with the library's own dependencies.

Builds a wheel from a copy of the repository (offline: ``pip wheel --no-deps
--no-build-isolation`` with this interpreter's setuptools) and reads what it would install.
"""

from __future__ import annotations

import configparser
import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the scripts, benchmarks and tests need; the library imports none of them.
SCRIPT_ONLY = ("matplotlib", "tensorflow-datasets", "tensorboard", "absl-py")
LIBRARY_IMPORTS = {"tensorflow", "keras", "numpy"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path_factory.mktemp("src")
    # The folders a careless `packages.find` would pick up travel with the library.
    for folder in ("tf_blocksparse", "launch", "models", "tests", "colab"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("tf_blocksparse-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_wheel_holds_only_the_library(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and top - dist_info == {"tf_blocksparse"}, sorted(top)
    library = {str(p.relative_to(ROOT)) for p in (ROOT / "tf_blocksparse").rglob("*.py")}
    assert library <= set(names), sorted(library - set(names))
    # Python sources, and the fused kernels' C++ source (built where installed); never a
    # built library.
    assert all(n.endswith(".py") or n == "tf_blocksparse/kernels/blocksparse_ops.cc"
               for n in names if n.startswith("tf_blocksparse/")), sorted(names)
    assert "tf_blocksparse/kernels/blocksparse_ops.cc" in names


def test_wheel_requires_only_what_the_library_imports(wheel):
    requires = _metadata(wheel).get_all("Requires-Dist") or []
    core = [r for r in requires if "extra ==" not in r]
    assert {_name(r) for r in core} == LIBRARY_IMPORTS, core
    for r in core:  # pinned to the tested minor versions
        assert "<" in r and ">=" in r, r
    extras = {}
    for r in requires:
        if "extra ==" in r:
            extra = re.search(r"extra == ['\"]([\w-]+)['\"]", r).group(1)
            extras.setdefault(extra, set()).add(_name(r))
    assert set(extras) == {"launch", "bench", "dev", "notebooks"}, extras
    assert set(SCRIPT_ONLY) <= extras["launch"], extras["launch"]


def test_library_imports_match_its_requirements():
    """No module of the package imports a third-party package outside its requirements."""
    stdlib = set(sys.stdlib_module_names)
    found = set()
    pattern = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", re.MULTILINE)
    for path in (ROOT / "tf_blocksparse").rglob("*.py"):
        text = path.read_text()
        # docstrings and comments can start a line with "from"/"import" too: only code counts
        code = re.sub(r'"""[\s\S]*?"""', "", text)
        # a module that also runs as a script by path imports its siblings by their bare names
        script = '__name__ == "__main__"' in code
        found |= {m for m in pattern.findall(code) if not m.startswith("_")
                  and not (script and (path.parent / f"{m}.py").exists())}
    third_party = found - stdlib - {"tf_blocksparse"}
    assert third_party <= LIBRARY_IMPORTS, sorted(third_party)


def test_wheel_installs_the_tfbs_run_launcher(wheel):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(name).decode())
    assert dict(entry_points["console_scripts"]) == {
        "tfbs-run": "tf_blocksparse.launcher.cli:main"}


def test_installed_tfbs_run_answers_help_and_usage_errors(wheel, tmp_path):
    """The console script pip writes runs from the installed package (not the checkout)."""
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = target / "bin" / "tfbs-run"
    assert script.is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "tfbs-run" in out.stdout and "--num_workers" in out.stdout
    bad = subprocess.run([str(script), "--num_workers=2"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "worker command" in bad.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import tf_blocksparse.launcher as m; print(m.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr
