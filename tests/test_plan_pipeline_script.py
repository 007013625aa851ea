"""launch/plan_pipeline.py: profile -> topology -> plans -> JSON files and a PNG (subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tf_blocksparse.planning import ModelProfile, PipelinePlan, Topology, plan_pipeline

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "launch.plan_pipeline"
GBIT = 1e9 / 8
# cnn_small at 8x8 (digits) has no first pooling layer.
CNN_SMALL_8X8 = ["conv1", "conv2", "pool2", "flatten", "fc1", "logits"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One quick run: cnn_small, 4 random devices, one timed call per layer function."""
    path = tmp_path_factory.mktemp("plan_pipeline")
    proc = run_script("--model=cnn_small", "--dataset=digits", "--batch_size=4",
                      "--profile_warmup=1", "--profile_repeats=1", "--topology=random",
                      "--num_devices=4", "--seed=1", f"--out={path}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return path, proc.stdout


def test_plan_json_covers_every_layer(out: tuple[Path, str]) -> None:
    path, _ = out
    plan = PipelinePlan.from_json((path / "plan.json").read_text())
    profile = ModelProfile.from_json((path / "profile.json").read_text())
    topology = Topology.from_json((path / "topology.json").read_text())
    assert [lp.name for lp in profile.layers] == CNN_SMALL_8X8
    assert all(lp.compute_s >= 0 for lp in profile.layers) and profile.total_compute_s > 0
    assert topology == Topology.random_heterogeneous(4, 10 * GBIT, 0.8, seed=1)
    assert plan.method == "bandwidth_dp"
    assert plan.stages[0].first_layer == 0
    assert plan.stages[-1].last_layer == profile.num_layers - 1
    for prev, nxt in zip(plan.stages, plan.stages[1:]):
        assert nxt.first_layer == prev.last_layer + 1
    assert len(set(plan.devices_used)) == len(plan.devices_used) <= 4
    plan.validate(profile, topology)  # times are the shared cost model's
    assert plan == plan_pipeline(profile, topology)
    for name, method in (("plan_pipedream.json", "pipedream"),
                         ("plan_oblivious.json", "oblivious")):
        other = PipelinePlan.from_json((path / name).read_text())
        assert other.method == method
        other.validate(profile, topology)


def test_png_and_printed_tables(out: tuple[Path, str]) -> None:
    path, stdout = out
    png = path / "stages.png"
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stage  layers" in stdout and "compute_ms" in stdout and "sync_ms" in stdout
    plan = PipelinePlan.from_json((path / "plan.json").read_text())
    assert f"bandwidth_dp: {plan.num_stages} stages" in stdout
    for method in ("bandwidth_dp", "pipedream", "oblivious"):
        assert any(line.startswith(method) and "bottleneck" in line
                   for line in stdout.splitlines())


def test_reads_profile_and_topology_json(out: tuple[Path, str], tmp_path: Path) -> None:
    path, _ = out
    proc = run_script(f"--profile_json={path / 'profile.json'}",
                      f"--topology_json={path / 'topology.json'}", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "plan.json").read_text() == (path / "plan.json").read_text()
    assert (tmp_path / "topology.json").read_text() == (path / "topology.json").read_text()


@pytest.mark.parametrize("args, flag", [
    (["--num_devices=0"], "num_devices"),
    (["--spread=1.5"], "spread"),
    (["--bandwidth_gbit=0"], "bandwidth_gbit"),
    (["--topology=two_level", "--num_devices=5", "--devices_per_node=2"], "devices_per_node"),
    (["--input_shape=8,x"], "input_shape"),
    (["--model=no_such_model"], "model"),
])
def test_bad_flag_names_the_flag(args: list[str], flag: str, tmp_path: Path) -> None:
    proc = run_script(*args, f"--out={tmp_path}")
    assert proc.returncode != 0
    assert f"--{flag}" in proc.stderr
    assert not (tmp_path / "plan.json").exists()


def test_unreadable_topology_json_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"bandwidth": [[0, 1], [2, 0]]}')  # not symmetric
    for name in ("missing.json", "bad.json"):
        proc = run_script(f"--topology_json={tmp_path / name}", f"--out={tmp_path / 'o'}")
        assert proc.returncode != 0
        assert "--topology_json" in proc.stderr
        assert not (tmp_path / "o").exists()
