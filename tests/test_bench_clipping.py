"""launch/bench_clipping.py: the record's schema on tiny settings (no timing thresholds).

The script runs in a subprocess: it needs its own process for its MirroredStrategy and
profiler sessions.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import bench_clipping
from launch.bench_clipping import OpEvent

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
        [sys.executable, str(ROOT / "launch" / "bench_clipping.py"), "--model=small_cnn",
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
    assert config["replicas"] == 2 and config["model"] == "small_cnn"
    assert config["buffer_bytes"] == config["gradient_bytes"] // 4 > 0
    assert config["variables"] > 0 and config["threshold"] == 1.0


def test_overlap_schema(record: dict, logdir: Path) -> None:
    overlap = record["overlap"]
    assert overlap["logdir"] == str(logdir) and overlap["trace_steps"] == TRACE_STEPS
    for variant in bench_clipping.OVERLAP_VARIANTS:  # one profiler session per traced step
        for step in range(TRACE_STEPS):
            assert glob.glob(str(logdir / f"{variant}_{step}" / "plugins" / "profile" / "*"
                                 / "*.xplane.pb"))
    assert set(overlap["variants"]) == set(bench_clipping.OVERLAP_VARIANTS)
    for row in overlap["variants"].values():
        assert 0.0 <= row["exchange_overlap_fraction"] <= 1.0
        assert 0.0 <= row["joint_exchange_overlap_fraction"] <= 1.0
        assert all(0.0 <= f <= 1.0 for f in row["joint_exchange_overlap_fraction_per_step"])
        assert row["joint_exchange_ms"] > 0
        assert row["joint_instances"] == row["collectives_per_replica"]
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
    assert step["repeats"] == REPEATS and step["baseline"] == bench_clipping.BASELINE
    assert set(step["variants"]) == set(bench_clipping.STEP_VARIANTS)
    ratio = f"ratio_vs_{bench_clipping.BASELINE}"
    for row in step["variants"].values():
        assert row["median_ms"] > 0 and row[ratio] > 0 and row["first_call_s"] > 0
        assert len(row["times_ms"]) == REPEATS and all(t > 0 for t in row["times_ms"])
        assert row["fusion_groups"] >= 1
    assert step["variants"][bench_clipping.BASELINE][ratio] == 1.0
    assert step["variants"]["local_clip_allgather"]["fusion_groups"] == (
        record["overlap"]["variants"]["fused"]["fusion_groups"])


def _event(name: str, op_type: str, start: int, end: int, key: int | None = None) -> OpEvent:
    return OpEvent(name, op_type, start, end, key)


def test_analyse_step_pools_replicas_and_clips_to_the_backward_window() -> None:
    events = [
        _event("gradient_tape/dense/MatMul", "MatMul", 0, 10),
        _event("dense/Relu", "ReluGrad", 5, 20),                      # backprop type
        _event("allgather/CollectiveGatherV2", "CollectiveGatherV2", 15, 25, key=7),
        _event("allgather/CollectiveGatherV2_1", "CollectiveGatherV2", 18, 22),  # nested
        _event("replica_1/gradient_tape/x/Conv2DBackpropFilter",
               "_MklNativeConv2DBackpropFilter", 0, 10),
        _event("allgather/CollectiveGatherV2_2", "CollectiveGatherV2", 19, 26, key=7),
        _event("replica_1/dense/MatMul", "MatMul", 0, 50),            # forward op
        _event("orphan/CollectiveAssignGroupV2", "CollectiveAssignGroupV2", 0, 99),
        _event("gradient_tape/lost/Mul", "Mul", 0, 99),                # no replica known
    ]
    placement = {"gradient_tape/dense/MatMul": 0, "dense/Relu": 0,
                 "allgather/CollectiveGatherV2": 0, "allgather/CollectiveGatherV2_1": 0,
                 "allgather/CollectiveGatherV2_2": 1}
    out = bench_clipping.analyse_step(events, placement, replicas=2)
    r0, r1 = out["per_replica"]
    assert (r0["backward_ops"], r0["collectives"], r1["backward_ops"], r1["collectives"]) == (
        2, 2, 1, 1)
    assert r0["exchange_in_backward_ms"] * 1e9 == pytest.approx(5)      # [15, 20] of [15, 25]
    assert r0["exchange_tail_after_backward_ms"] * 1e9 == pytest.approx(5)
    assert r1["exchange_in_backward_ms"] == 0.0                         # window [0, 10]
    assert r1["first_exchange_start_minus_backward_end_ms"] * 1e9 == pytest.approx(9)
    assert out["exchange_overlap_fraction"] == pytest.approx(5 / 17)
    # instance 7: both replicas in it from 19 to 26; joint backward window [0, 20]
    assert out["joint_instances"] == 1
    assert out["joint_exchange_ms"] * 1e9 == pytest.approx(7)
    assert out["joint_exchange_overlap_fraction"] == pytest.approx(1 / 7)
    assert out["collective_types"] == {"CollectiveGatherV2": 3}
    assert out["unassigned_backward_or_exchange_ops"] == 1


def test_interval_helpers() -> None:
    spans = bench_clipping.union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert spans == [(0, 3), (5, 9)]
    assert bench_clipping.length(spans) == 7
    assert bench_clipping.inside(spans, 2, 6) == 2
