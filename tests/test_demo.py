"""The main job end to end: 2-worker MWMS clusters on real data (slow)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_runs_and_reports_compression(tmp_path):
    subprocess.run([sys.executable, "-m", "launch.demo", "--epochs=1",
                    "--train_samples=4000", "--test_samples=1000", f"--out={tmp_path}",
                    "--links="],
                   check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())[
        "results"]}
    assert rows["dense"]["compression_ratio"] == 1.0
    # the automatic exchange measures loopback: whatever it chose, it sent no more than dense
    assert rows["block default"]["compression_ratio"] >= 1.0
    assert rows["block k=1"]["compression_ratio"] > 20
    assert rows["block literal"]["compression_ratio"] > rows["block k=1"]["compression_ratio"]
    assert all(r["test_examples"] == 1000 for r in rows.values())  # each test image once
    assert all(r["num_workers"] == 2 and r["link"] == "loopback" for r in rows.values())
    assert all(len(r["epoch_wall_s"]) == 1 and r["wall_s"] >= r["epoch_wall_s"][0]
               for r in rows.values())
    assert all(r["test_accuracy"] > 0.15 for r in rows.values())
    assert (tmp_path / "accuracy_vs_bytes.png").stat().st_size > 1000
