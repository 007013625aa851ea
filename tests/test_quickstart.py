"""The README's Quick start, verbatim, on two worker processes with ``tfbs-run``.

Its data come from ``keras.datasets.fashion_mnist.load_data()`` as for any user: the test puts
Debian's Fashion-MNIST IDX files where Keras caches its downloads (``$KERAS_HOME``), so Keras
reads them as it would after downloading (uint8 images and labels).  Slow: three epochs of
full Fashion-MNIST on two workers (a few minutes on 2 cores).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FASHION = Path(os.environ.get("FASHION_DIR", "/usr/share/datasets/fashion-mnist"))
FILES = ("train-labels-idx1-ubyte.gz", "train-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz")


def quickstart_code() -> str:
    """The Python block under the README's ``## Quick start`` heading."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Quick start has no python block"
    return match.group(1)


def test_the_quickstart_block_is_found_and_uses_keras_datasets():
    code = quickstart_code()
    assert "keras.datasets.fashion_mnist.load_data()" in code
    assert "tfbs.fit_callbacks(model" in code and "evaluate_exactly" in code
    compile(code, "quickstart.py", "exec")


@pytest.mark.slow
@pytest.mark.skipif(not all((FASHION / f).exists() for f in FILES),
                    reason="Fashion-MNIST IDX files not found (make data)")
def test_readme_quickstart_runs_verbatim_on_two_workers(tmp_path):
    home = tmp_path / "keras_home"
    cache = home / "datasets" / "fashion-mnist"
    cache.mkdir(parents=True)
    for name in FILES:
        shutil.copy(FASHION / name, cache / name)
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    run = shutil.which("tfbs-run", path=os.path.dirname(sys.executable))
    assert run, "the tfbs-run console script is not installed"
    env = {**os.environ, "KERAS_HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([run, "--num_workers=2", "--", sys.executable, str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    results = re.findall(r"EvalResult\(loss=[^,]+, accuracy=([0-9.]+), correct=(\d+), "
                         r"counted=(\d+), examples=(\d+)\)", out)
    assert len(results) == 2, out[-5000:]  # one line per worker, the same figures
    assert results[0] == results[1]
    accuracy, _, counted, examples = results[0]
    assert int(counted) == int(examples) == 10_000
    assert float(accuracy) > 0.85, results
    assert "payload_bytes" in out
