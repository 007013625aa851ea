"""Pipeline schedule simulator: hand-computed timelines and bounds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse.planning import (
    LayerProfile,
    ModelProfile,
    Topology,
    make_plan,
    plan_pipeline,
    schedule_order,
    simulate_pipeline,
)


def two_stage(f=1.0, b=2.0, t=0.5):
    """Two 1-device stages, forward f and backward b each, transfers of t seconds."""
    p = ModelProfile([LayerProfile("a", f + b, 100 * t, 0, forward_s=f),
                      LayerProfile("b", f + b, 0, 0, forward_s=f)])
    topo = Topology([[0, 100], [100, 0]])
    return p, topo, make_plan(p, topo, [(0, 0, (0,)), (1, 1, (1,))])


def test_gpipe_two_stages_by_hand():
    p, topo, plan = two_stage()
    out = simulate_pipeline(p, topo, plan, 2, "gpipe", micro_batch_size=8, return_events=True)
    assert out["makespan_s"] == 10.0
    assert out["throughput_samples_per_s"] == pytest.approx(16 / 10)
    assert out["minibatches_per_s"] == pytest.approx(0.1)
    assert out["busy_fraction"] == [pytest.approx(0.6), pytest.approx(0.6)]
    timeline = [(e["kind"], e["stage"], e["micro_batch"], e["start_s"], e["end_s"])
                for e in out["events"] if e["kind"] != "allreduce"]
    assert timeline == [
        ("forward", 0, 0, 0.0, 1.0), ("send_activation", 0, 0, 1.0, 1.5),
        ("forward", 0, 1, 1.0, 2.0), ("forward", 1, 0, 1.5, 2.5),
        ("send_activation", 0, 1, 2.0, 2.5), ("forward", 1, 1, 2.5, 3.5),
        ("backward", 1, 0, 3.5, 5.5), ("send_gradient", 1, 0, 5.5, 6.0),
        ("backward", 1, 1, 5.5, 7.5), ("backward", 0, 0, 6.0, 8.0),
        ("send_gradient", 1, 1, 7.5, 8.0), ("backward", 0, 1, 8.0, 10.0),
    ]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_gpipe_two_stages_closed_form(m):
    # Stage 1 works from f + t to f + t + M (f + b); the last gradient takes t more and
    # stage 0's backwards then never wait: (M + 1)(f + b) + 2t.
    f, b, t = 1.0, 2.0, 0.25
    p, topo, plan = two_stage(f, b, t)
    assert simulate_pipeline(p, topo, plan, m)["makespan_s"] == pytest.approx(
        (m + 1) * (f + b) + 2 * t)


def test_1f1b_two_stages_by_hand():
    p, topo, plan = two_stage()
    assert simulate_pipeline(p, topo, plan, 2, "1f1b")["makespan_s"] == 10.0
    # M = 4: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 alternates from the start; worked
    # out by hand, the last backward of stage 0 runs from 15 to 17.
    assert simulate_pipeline(p, topo, plan, 4, "1f1b")["makespan_s"] == 17.0


def test_data_parallel_stage_and_sync():
    # One stage on 2 devices: each micro-batch is split over both replicas, then one
    # all-reduce of 2 (r-1)/r * 10 B / 5 B/s = 2 s.
    p = ModelProfile([LayerProfile("a", 3.0, 7, 10)])
    topo = Topology.homogeneous(2, 5.0)
    plan = make_plan(p, topo, [(0, 0, (0, 1))])
    out = simulate_pipeline(p, topo, plan, 3, return_events=True)
    assert out["makespan_s"] == pytest.approx(3 * 3.0 / 2 + 2.0)
    assert out["sync_s"] == [pytest.approx(2.0)]
    assert out["stage_forward_s"] == [pytest.approx(0.5)]  # default forward share 1/3
    assert out["events"][-1]["kind"] == "allreduce"


def test_schedule_orders():
    assert schedule_order("gpipe", 3, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert schedule_order("1f1b", 4, 0, 5) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("B", 2),
        ("B", 3), ("B", 4)]
    assert schedule_order("1f1b", 4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule_order("1f1b", 4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="schedule"):
        schedule_order("zb", 2, 0, 2)


def test_bad_arguments():
    p, topo, plan = two_stage()
    with pytest.raises(ValueError, match="schedule"):
        simulate_pipeline(p, topo, plan, 2, "interleaved")
    with pytest.raises(ValueError, match="micro_batches"):
        simulate_pipeline(p, topo, plan, 0)
    with pytest.raises(ValueError, match="forward_fraction"):
        simulate_pipeline(p, topo, plan, 2, forward_fraction=1.5)
    with pytest.raises(ValueError, match="cover"):
        simulate_pipeline(ModelProfile(p.layers * 2), topo, plan, 2)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 4))
    layers = [LayerProfile(f"l{i}", draw(st.floats(0.0, 3.0)), draw(st.integers(0, 30)),
                           draw(st.integers(0, 30))) for i in range(n)]
    m = [[0.0] * d for _ in range(d)]
    for a in range(d):
        for b in range(a):
            m[a][b] = m[b][a] = draw(st.floats(1.0, 20.0))
    return ModelProfile(layers), Topology(m), draw(st.integers(1, 6))


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(["gpipe", "1f1b"]), st.booleans())
def test_makespan_bounds_and_event_consistency(case, schedule, duplex):
    p, topo, m = case
    plan = plan_pipeline(p, topo)
    out = simulate_pipeline(p, topo, plan, m, schedule, full_duplex=duplex, return_events=True)
    span, fwd, bwd = out["makespan_s"], out["stage_forward_s"], out["stage_backward_s"]
    work = [m * (f + b) for f, b in zip(fwd, bwd)]
    for s, stage in enumerate(plan.stages):
        assert fwd[s] + bwd[s] == pytest.approx(stage.compute_s, abs=1e-12)
        # A stage does all its work, then syncs.
        assert span >= work[s] + out["sync_s"][s] - 1e-9
    assert span >= m * max(out["transfer_s"], default=0.0) - 1e-9
    sequential = sum(work) + 2 * m * sum(out["transfer_s"]) + sum(out["sync_s"])
    assert span <= sequential + 1e-9
    assert all(0 <= f <= 1 + 1e-12 for f in out["busy_fraction"])
    events = out["events"]
    ops = {(e["kind"], e["stage"], e["micro_batch"]): e for e in events}
    for s in range(plan.num_stages):  # one op at a time per stage
        mine = sorted((e["start_s"], e["end_s"]) for e in events
                      if e["stage"] == s and e["kind"] in ("forward", "backward"))
        assert len(mine) == 2 * m
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))
        for k in range(m):
            assert ops[("backward", s, k)]["start_s"] >= ops[("forward", s, k)]["end_s"]
            if s:
                assert ops[("forward", s, k)]["start_s"] >= \
                    ops[("send_activation", s - 1, k)]["end_s"]
                assert ops[("send_activation", s - 1, k)]["start_s"] >= \
                    ops[("forward", s - 1, k)]["end_s"]
            if s < plan.num_stages - 1:
                assert ops[("backward", s, k)]["start_s"] >= \
                    ops[("send_gradient", s + 1, k)]["end_s"]
    if duplex:
        half = simulate_pipeline(p, topo, plan, m, schedule, full_duplex=False)
        assert half["makespan_s"] >= span - 1e-9
