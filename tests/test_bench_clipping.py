"""launch/bench_clipping.py (its body, launch/benches/clipping.py): the record's schema on tiny
settings (no timing thresholds).

The script runs in a subprocess: it needs its own process for its MirroredStrategy and
profiler sessions.  Marked slow (about 45 s of one test process, the heaviest file of the
default suite): the clipping rules and their overlap with the exchange are checked against
NumPy in ``tests/test_clipping.py``; this file checks only the benchmark's record.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import clipping_variants
from launch.benches.clipping import TRACE_ATTEMPTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 2
TRACE_STEPS = 1


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench_clipping_trace")


@pytest.fixture(scope="module")
def record(logdir: Path) -> dict:
    """One tiny run of the script; its stdout's last line is the JSON record."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench_clipping", "--model=cnn_bn",
         "--image_size=16", "--batch=2", "--warmup=1", f"--repeats={REPEATS}",
         f"--trace_steps={TRACE_STEPS}", f"--logdir={logdir}"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def test_record_is_strict_json(record: dict) -> None:
    assert json.loads(json.dumps(record, allow_nan=False)) == record
    assert {"config", "overlap", "step_time", "section_seconds", "machine"} <= set(record)
    assert record["machine"]["logical_cpus"] >= 2 and record["machine"]["cpus"] > 0
    config = record["config"]
    assert config["replicas"] == 2 and config["model"] == "cnn_bn"
    assert config["buffer_bytes"] == config["gradient_bytes"] // 4 > 0
    assert config["variables"] > 0 and config["threshold"] == 1.0


def test_overlap_schema(record: dict, logdir: Path) -> None:
    overlap = record["overlap"]
    assert overlap["logdir"] == str(logdir) and overlap["trace_steps"] == TRACE_STEPS
    for variant in clipping_variants.OVERLAP_VARIANTS:  # one profiler session per traced step
        for step in range(TRACE_STEPS):
            assert glob.glob(str(logdir / f"{variant}_{step}" / "plugins" / "profile" / "*"
                                 / "*.xplane.pb"))
    assert set(overlap["variants"]) == set(clipping_variants.OVERLAP_VARIANTS)
    for row in overlap["variants"].values():
        assert 0.0 <= row["exchange_overlap_fraction"] <= 1.0
        assert 0.0 <= row["joint_exchange_overlap_fraction"] <= 1.0
        assert all(0.0 <= f <= 1.0 for f in row["joint_exchange_overlap_fraction_per_step"])
        assert row["joint_exchange_ms"] > 0
        # every collective of the traced steps seen on both replicas (steps whose trace
        # missed an event are traced again, at most TRACE_ATTEMPTS times)
        assert row["unmatched_instances"] == 0 and row["unkeyed_collectives"] == 0
        assert row["joint_instances"] == row["collectives_per_replica"]
        assert len(row["trace_attempts"]) == TRACE_STEPS
        assert all(1 <= a <= TRACE_ATTEMPTS for a in row["trace_attempts"])
        assert len(row["exchange_overlap_fraction_per_step"]) == TRACE_STEPS
        assert all(0.0 <= f <= 1.0 for f in row["exchange_overlap_fraction_per_step"])
        assert row["backward_ms"] > 0 and row["exchange_ms"] > 0
        assert 0.0 <= row["exchange_in_backward_ms"] <= row["exchange_ms"] + 1e-3
        assert row["exchange_tail_after_backward_ms"] >= 0
        assert row["backward_ops_per_replica"] > 0
        # allgather: the sparse buffers, plus one reduce of the variables sent whole
        assert set(row["collective_types"]) == {"CollectiveGatherV2", "CollectiveReduceV2"}
        # allgather: one gather of block ids and one of block values per fusion group, and
        # one reduce in each group that holds variables sent whole (dense_below)
        assert 2 * row["fusion_groups"] < row["collectives_per_replica"] \
            <= 3 * row["fusion_groups"]
        assert row["unassigned_backward_or_exchange_ops"] == 0
        assert len(row["steps"]) == 2 * TRACE_STEPS
    assert overlap["variants"]["single_group"]["fusion_groups"] == 1
    assert overlap["variants"]["fused"]["fusion_groups"] > 1
    assert isinstance(overlap["fused_overlap_exceeds_single_group"], bool)
    assert isinstance(overlap["fused_joint_overlap_exceeds_single_group"], bool)


def test_step_time_schema(record: dict) -> None:
    step = record["step_time"]
    assert step["repeats"] == REPEATS and step["baseline"] == clipping_variants.BASELINE
    assert set(step["variants"]) == set(clipping_variants.STEP_VARIANTS)
    ratio = f"ratio_vs_{clipping_variants.BASELINE}"
    for row in step["variants"].values():
        assert row["median_ms"] > 0 and row[ratio] > 0 and row["first_call_s"] > 0
        assert len(row["times_ms"]) == REPEATS and all(t > 0 for t in row["times_ms"])
        assert row["fusion_groups"] >= 1
    assert step["variants"][clipping_variants.BASELINE][ratio] == 1.0
    assert step["variants"]["local_clip_allgather"]["fusion_groups"] == (
        record["overlap"]["variants"]["fused"]["fusion_groups"])
