"""The demo end to end on real data (slow: three short trainings in a subprocess)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_runs_and_reports_compression(tmp_path):
    out = tmp_path / "demo.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "demo.py"), "--epochs=1",
                    "--train_samples=3000", f"--out={out}"], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["dense"]["compression"] == 1.0
    assert rows["block k=1 (allgather)"]["compression"] > 20
    assert all(r["test_accuracy"] > 0.15 for r in rows.values())
