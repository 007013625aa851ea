"""launch/trace_analysis.py: replicas, backward window and exchange overlap of a trace."""

from __future__ import annotations

import pytest

from launch import trace_analysis
from launch.trace_analysis import OpEvent


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
    out = trace_analysis.analyse_step(events, placement, replicas=2)
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
    assert (out["unmatched_instances"], out["unkeyed_collectives"]) == (0, 1)
    assert not trace_analysis.complete(out)  # the nested collective has no key
    assert out["joint_exchange_ms"] * 1e9 == pytest.approx(7)
    assert out["joint_exchange_overlap_fraction"] == pytest.approx(1 / 7)
    assert out["collective_types"] == {"CollectiveGatherV2": 3}
    assert out["unassigned_backward_or_exchange_ops"] == 1


def test_a_collective_missing_on_one_replica_is_unmatched_and_the_trace_incomplete() -> None:
    placement = {"g0": 0, "g1": 1, "a0": 0, "a1": 1, "b0": 0, "b1": 1, "c1": 1}
    events = [_event("g0", "ReluGrad", 0, 10), _event("g1", "ReluGrad", 0, 10),
              _event("a0", "CollectiveReduceV2", 5, 15, key=1),
              _event("a1", "CollectiveReduceV2", 6, 16, key=1),
              _event("b0", "CollectiveGatherV2", 20, 30, key=2),
              _event("b1", "CollectiveGatherV2", 21, 31, key=2)]
    whole = trace_analysis.analyse_step(events, placement, replicas=2)
    assert (whole["joint_instances"], whole["unmatched_instances"]) == (2, 0)
    assert whole["unkeyed_collectives"] == 0 and trace_analysis.complete(whole)
    dropped = trace_analysis.analyse_step(events[:-1], placement, replicas=2)  # b1 lost
    assert (dropped["joint_instances"], dropped["unmatched_instances"]) == (1, 1)
    assert dropped["joint_exchange_ms"] * 1e9 == pytest.approx(10)  # instance 1 only
    assert not trace_analysis.complete(dropped)
    twice = trace_analysis.analyse_step(
        [*events, _event("c1", "CollectiveGatherV2", 40, 50, key=2)], placement, replicas=2)
    assert (twice["joint_instances"], twice["unmatched_instances"]) == (1, 1)
    assert not trace_analysis.complete(twice)


def test_interval_helpers() -> None:
    spans = trace_analysis.union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert spans == [(0, 3), (5, 9)]
    assert trace_analysis.length(spans) == 7
    assert trace_analysis.inside(spans, 2, 6) == 2


def test_backward_and_exchange_rules() -> None:
    assert trace_analysis.is_backward(_event("gradient_tape/a/MatMul", "MatMul", 0, 1))
    assert trace_analysis.is_backward(_event("a/b", "ReluGrad", 0, 1))
    assert trace_analysis.is_backward(_event("a/b", "_MklNativeConv2DBackpropFilter", 0, 1))
    assert not trace_analysis.is_backward(_event("a/MatMul", "MatMul", 0, 1))
    assert trace_analysis.is_exchange(_event("x", "CollectiveReduceV2", 0, 1))
    assert not trace_analysis.is_exchange(_event("x", "CollectiveAssignGroupV2", 0, 1))
    assert trace_analysis.replica_of(_event("replica_3/a", "Add", 0, 1), {}) == 3
    assert trace_analysis.replica_of(_event("a", "Add", 0, 1), {"a": 1}) == 1
    assert trace_analysis.replica_of(_event("a", "Add", 0, 1), {}) is None


def test_analyse_step_names_a_replica_without_collectives() -> None:
    events = [_event("gradient_tape/a", "MatMul", 0, 1)]
    with pytest.raises(RuntimeError, match="replica 0: 1 backward ops, 0 collectives"):
        trace_analysis.analyse_step(events, {"gradient_tape/a": 0}, replicas=1)
