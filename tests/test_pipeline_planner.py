"""Bandwidth-aware pipeline planner: profiles, topologies, cost model, DP, searches."""

import json
import math
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse import planning
from tf_blocksparse.planning import (
    LayerProfile,
    ModelProfile,
    PipelinePlan,
    Stage,
    Topology,
    evaluate_stages,
    make_plan,
    plan_bruteforce,
    plan_cost,
    plan_exhaustive,
    plan_pipeline,
    random_profile,
    stage_time,
    synthetic_profile,
    validate_plan,
)

PLANNING = pathlib.Path(__file__).resolve().parents[1] / "tf_blocksparse" / "planning"
FAST = settings(max_examples=60, deadline=None)
REL = 1e-9


def prof(compute, act=None, params=None):
    act = act if act is not None else [0] * len(compute)
    params = params if params is not None else [0] * len(compute)
    return ModelProfile([LayerProfile(f"l{i}", c, a, p)
                         for i, (c, a, p) in enumerate(zip(compute, act, params))])


def recompute(profile, topology, plan):
    """The cost model written out from the spec, independent of the library's helpers."""
    times, prev = [], None
    for stage in plan.stages:
        i, j, d = stage.first_layer, stage.last_layer, stage.devices
        r = len(d)
        t = sum(x.compute_s for x in profile.layers[i:j + 1]) / r
        if i > 0:
            t += profile.layers[i - 1].activation_bytes / topology.bandwidth[prev[-1]][d[0]]
        if r > 1:
            ring = min(topology.bandwidth[d[k]][d[(k + 1) % r]] for k in range(r))
            t += 2 * (r - 1) / r * sum(x.param_bytes for x in profile.layers[i:j + 1]) / ring
        times.append(t)
        prev = d
    return max(times)


# -- profiles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, arg", [
    ({"compute_s": -1.0}, "compute_s"), ({"compute_s": math.nan}, "compute_s"),
    ({"activation_bytes": -5}, "activation_bytes"), ({"param_bytes": math.inf}, "param_bytes"),
    ({"param_bytes": "7"}, "param_bytes"), ({"compute_s": True}, "compute_s"),
    ({"forward_s": 2.0}, "forward_s"),
])
def test_layer_profile_rejects_bad_values(kwargs, arg):
    base = {"name": "x", "compute_s": 1.0, "activation_bytes": 10, "param_bytes": 10}
    with pytest.raises(ValueError, match=arg):
        LayerProfile(**{**base, **kwargs})


def test_model_profile_tables_json_and_validation():
    import numpy as np
    p = ModelProfile([LayerProfile("a", 1.0, 10, 4, forward_s=0.25),
                      LayerProfile("b", np.float32(2.0), np.int64(20), 6)],
                     name="m", metadata={"batch": 32})
    assert isinstance(p.layers, tuple) and p.num_layers == len(p) == 2
    assert type(p.layers[1].activation_bytes) is int  # numpy scalars become Python numbers
    assert p.cumulative_compute == (0.0, 1.0, 3.0)
    assert p.cumulative_param_bytes == (0.0, 4.0, 10.0)
    assert len(p.cumulative_activation_bytes) == 3
    assert ModelProfile.from_json(p.to_json()) == p
    assert json.loads(p.to_json())["metadata"] == {"batch": 32}
    hash(p)
    with pytest.raises(ValueError, match="layers"):
        ModelProfile([])
    with pytest.raises(ValueError, match="metadata"):
        ModelProfile(p.layers, metadata={"x": object()})


def test_profile_builders_are_deterministic_and_shaped():
    assert random_profile(30, seed=1) == random_profile(30, seed=1) != random_profile(30, seed=2)
    cnn = synthetic_profile("cnn", 16, jitter=0.0)
    acts = [x.activation_bytes for x in cnn.layers]
    params = [x.param_bytes for x in cnn.layers]
    assert acts[0] > acts[-2] > acts[-1] and params[0] < params[-2] < params[-1]
    for kind in ("uniform", "transformer"):
        p = synthetic_profile(kind, 10)
        assert p.num_layers == 10 and ModelProfile.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="kind"):
        synthetic_profile("rnn", 4)
    with pytest.raises(ValueError, match="num_layers"):
        random_profile(0)


# -- topologies -------------------------------------------------------------------------------

@pytest.mark.parametrize("bw", [
    [], [[0, 1]], [[0, 1], [1, 0], [1, 1]], [[0, 1], [2, 0]], [[0, 0], [0, 0]],
    [[0, -1], [-1, 0]], [[0, math.inf], [math.inf, 0]], [[0, math.nan], [math.nan, 0]],
])
def test_topology_rejects_bad_bandwidth(bw):
    with pytest.raises(ValueError, match="bandwidth"):
        Topology(bw)


def test_topology_basics_and_json():
    t = Topology([[math.inf, 3, 1], [3, 0, 2], [1, 2, 0]])
    assert t.bandwidth == ((0.0, 3.0, 1.0), (3.0, 0.0, 2.0), (1.0, 2.0, 0.0))
    assert t.num_devices == 3 and t.names == ("device_0", "device_1", "device_2")
    assert [t.total_bandwidth(d) for d in range(3)] == [4.0, 5.0, 3.0]
    assert t.bandwidth_order() == (1, 0, 2)
    assert Topology([[0, 1, 1], [1, 0, 1], [1, 1, 0]]).bandwidth_order() == (0, 1, 2)  # ties
    assert t.ring_bandwidth((0, 1, 2)) == 1.0 and t.ring_bandwidth((2,)) == math.inf
    assert Topology.from_json(t.to_json()) == t
    assert json.loads(t.to_json())["bandwidth"][0][0] == 0.0  # standard JSON, no Infinity
    with pytest.raises(ValueError, match="names"):
        Topology([[0, 1], [1, 0]], names=("a",))


def test_topology_builders():
    h = Topology.homogeneous(3, 5.0)
    assert h == planning.homogeneous(3, 5.0) and set(h.off_diagonal()) == {5.0}
    two = Topology.two_level(2, 2, 10.0, 1.0)
    assert two == planning.two_level(2, 2, 10.0, 1.0)
    assert two.bandwidth[0][1] == two.bandwidth[2][3] == 10.0
    assert two.bandwidth[1][2] == two.bandwidth[0][3] == 1.0
    assert two.names == ("node0/dev0", "node0/dev1", "node1/dev0", "node1/dev1")
    r = Topology.random_heterogeneous(8, 1e9, spread=0.8, seed=3)
    assert r == planning.random_heterogeneous(8, 1e9, 0.8, 3)
    assert r != Topology.random_heterogeneous(8, 1e9, spread=0.8, seed=4)
    links = r.off_diagonal()
    assert links.min() >= 0.2 * links.max() and links.max() <= 1e9
    assert all(r.bandwidth[a][b] == r.bandwidth[b][a] for a in range(8) for b in range(8))
    for bad in (lambda: Topology.random_heterogeneous(4, 1e9, spread=1.0),
                lambda: Topology.homogeneous(0, 1.0), lambda: Topology.two_level(2, 0, 1, 1)):
        with pytest.raises(ValueError):
            bad()


# -- stages, plans, cost model -------------------------------------------------------------

def test_stage_time_by_hand():
    p = prof([1.0, 2.0, 3.0], act=[100, 50, 0], params=[0, 30, 60])
    t = Topology([[0, 10, 20, 40], [10, 0, 30, 5], [20, 30, 0, 10], [40, 5, 10, 0]])
    assert stage_time(p, t, 0, 0, (0,)) == (1.0, 0.0, 0.0)
    # layers 1..2 on ring 3 -> 1 -> 2 -> 3: edges 5, 30, 10, 10 -> min 5
    c, m, s = stage_time(p, t, 1, 2, (3, 1, 2), prev_devices=(0,))
    assert c == pytest.approx(5.0 / 3) and m == pytest.approx(100 / 40)
    assert s == pytest.approx(2 * 2 / 3 * 90 / 5)
    with pytest.raises(ValueError, match="prev_devices"):
        stage_time(p, t, 1, 2, (3,))
    with pytest.raises(ValueError, match="devices"):
        stage_time(p, t, 0, 0, (4,))
    spans = [(0, 0, (0,)), (1, 2, (3, 1, 2))]
    assert plan_cost(p, t, spans) == pytest.approx(max(1.0, c + m + s))
    stages = evaluate_stages(p, t, spans)
    assert stages[1].time_s == pytest.approx(c + m + s)
    plan = make_plan(p, t, spans)
    assert plan.bottleneck_s == pytest.approx(recompute(p, t, plan))
    assert plan.devices_used == (0, 3, 1, 2) and plan.num_layers == 3


@pytest.mark.parametrize("stages, arg", [
    ([], "stages"),
    ([Stage(1, 2, (0,))], "stages"),
    ([Stage(0, 0, (0,)), Stage(2, 2, (1,))], "stages"),
    ([Stage(0, 0, (0,)), Stage(1, 1, (0, 1))], "reuses"),
])
def test_plan_rejects_bad_structure(stages, arg):
    with pytest.raises(ValueError, match=arg):
        PipelinePlan(stages)


def test_stage_and_plan_construction_checks():
    with pytest.raises(ValueError, match="devices"):
        Stage(0, 1, ())
    with pytest.raises(ValueError, match="devices"):
        Stage(0, 1, (1, 1))
    with pytest.raises(ValueError, match="last_layer"):
        Stage(2, 1, (0,))
    with pytest.raises(ValueError, match="time_s"):
        Stage(0, 1, (0,), 1.0, 0.0, 0.0, time_s=5.0)
    with pytest.raises(ValueError, match="bottleneck_s"):
        PipelinePlan((Stage(0, 0, (0,), 1.0),), bottleneck_s=3.0)


def test_validate_plan_checks_coverage_range_and_times():
    p = prof([1.0, 1.0, 1.0], act=[8, 8, 8], params=[4, 4, 4])
    t = Topology.homogeneous(3, 2.0)
    plan = make_plan(p, t, [(0, 0, (0,)), (1, 2, (1, 2))])
    validate_plan(plan, p, t)
    with pytest.raises(ValueError, match="cover"):
        validate_plan(plan, prof([1.0] * 4), t)
    with pytest.raises(ValueError, match="device"):
        validate_plan(PipelinePlan((Stage(0, 2, (5,)),)), p, t)
    with pytest.raises(ValueError, match="cost model"):  # same structure, other bandwidths
        validate_plan(plan, p, Topology.homogeneous(3, 4.0))
    validate_plan(plan, p)  # structure only


def test_plan_json_round_trip():
    p = random_profile(12, seed=5)
    t = Topology.random_heterogeneous(5, 1e9, seed=5)
    plan = plan_pipeline(p, t)
    back = PipelinePlan.from_json(plan.to_json())
    assert back == plan and isinstance(back.stages[0].devices, tuple)
    back.validate(p, t)


# -- the planner ------------------------------------------------------------------------------

def test_plan_pipeline_avoids_slow_links():
    # Device 3 has only slow links; every cut sends a big activation, every replica syncs.
    bw = [[0, 100, 100, 1], [100, 0, 100, 1], [100, 100, 0, 1], [1, 1, 1, 0]]
    t = Topology(bw)
    p = prof([1.0] * 4, act=[50] * 4, params=[10] * 4)
    plan = plan_pipeline(p, t)
    assert plan.method == "bandwidth_dp" and plan.device_order == (0, 1, 2, 3)
    assert 3 not in plan.devices_used
    assert plan.bottleneck_s == pytest.approx(recompute(p, t, plan), rel=REL)
    assert plan.bottleneck_s <= plan_cost(p, t, [(0, 0, (3,)), (1, 1, (0,)), (2, 2, (1,)),
                                                 (3, 3, (2,))])


def test_tie_rule_fewest_devices_then_fewest_stages():
    t = Topology.homogeneous(4, 1.0)
    # 1 stage on 4 devices and 2 stages on 2 + 2 both give 0.5: fewer stages wins.
    plan = plan_pipeline(prof([1.0, 1.0]), t)
    assert [(s.first_layer, s.last_layer, s.devices) for s in plan.stages] == \
        [(0, 1, (0, 1, 2, 3))]
    # Layer 1's parameters forbid replication, so layer 0 on 1 or 2 devices ties at 1.0.
    t3 = Topology.homogeneous(3, 1.0)
    plan = plan_pipeline(prof([1.0, 1.0], params=[0, 1e9]), t3)
    assert plan.bottleneck_s == 1.0
    assert [(s.first_layer, s.last_layer, s.devices) for s in plan.stages] == \
        [(0, 0, (0,)), (1, 1, (1,))]
    # Nothing to gain from any device: one device, one stage.
    plan = plan_pipeline(prof([0.0, 0.0, 0.0]), t)
    assert plan.bottleneck_s == 0.0 and plan.devices_used == (0,)


def test_single_layer_and_single_device():
    t1 = Topology([[0]])
    p = random_profile(5, seed=2)
    plan = plan_pipeline(p, t1)
    assert plan.stages == (Stage(0, 4, (0,), plan.stages[0].compute_s),)
    assert plan.bottleneck_s == pytest.approx(p.total_compute_s)
    one = prof([2.0], params=[0])
    assert plan_pipeline(one, Topology.homogeneous(3, 1.0)).bottleneck_s == pytest.approx(2 / 3)


def test_device_order_override_and_checks():
    p = prof([1.0, 1.0], act=[10, 0])
    t = Topology([[0, 1, 9], [1, 0, 2], [9, 2, 0]])
    assert plan_pipeline(p, t, device_order=(1, 0)).device_order == (1, 0)
    assert set(plan_pipeline(p, t, device_order=(1, 0)).devices_used) <= {0, 1}
    with pytest.raises(ValueError, match="device_order"):
        plan_pipeline(p, t, device_order=(0, 0))
    with pytest.raises(ValueError, match="max_layers"):
        plan_exhaustive(prof([1.0] * 9), t)


def test_large_plan_is_valid():
    p = random_profile(200, seed=0)
    t = Topology.random_heterogeneous(16, 1e10, seed=0)
    plan = plan_pipeline(p, t)
    plan.validate(p, t)
    assert plan.bottleneck_s == pytest.approx(recompute(p, t, plan), rel=REL)
    assert len(set(plan.devices_used)) == len(plan.devices_used) <= 16


@st.composite
def cases(draw, max_layers=6, max_devices=4):
    n = draw(st.integers(1, max_layers))
    d = draw(st.integers(1, max_devices))
    num = st.one_of(st.just(0.0), st.floats(0.0, 10.0), st.sampled_from([1.0, 2.0]))
    layers = [LayerProfile(f"l{i}", draw(num), draw(st.one_of(st.just(0), st.integers(0, 50))),
                           draw(st.one_of(st.just(0), st.integers(0, 50)))) for i in range(n)]
    bws = st.one_of(st.sampled_from([1.0, 2.0, 5.0]), st.floats(0.5, 50.0))
    m = [[0.0] * d for _ in range(d)]
    for a in range(d):
        for b in range(a):
            m[a][b] = m[b][a] = draw(bws)
    return ModelProfile(layers), Topology(m)


@settings(max_examples=150, deadline=None)
@given(cases(max_layers=8, max_devices=4))
def test_dp_equals_exhaustive(case):
    p, t = case
    plan, ex = plan_pipeline(p, t), plan_exhaustive(p, t)
    plan.validate(p, t)
    assert plan.bottleneck_s == pytest.approx(ex.bottleneck_s, rel=REL, abs=1e-12)
    assert plan.bottleneck_s == pytest.approx(recompute(p, t, plan), rel=REL, abs=1e-12)
    assert ex.bottleneck_s == pytest.approx(recompute(p, t, ex), rel=REL, abs=1e-12)
    # Same tie rule: fewest devices, then fewest stages.
    assert (len(plan.devices_used), plan.num_stages) == (len(ex.devices_used), ex.num_stages)
    assert PipelinePlan.from_json(plan.to_json()) == plan


@settings(max_examples=25, deadline=None)
@given(cases(max_layers=4, max_devices=3))
def test_bruteforce_bounds_the_dp(case):
    p, t = case
    plan, brute = plan_pipeline(p, t), plan_bruteforce(p, t)
    brute.validate(p, t)
    assert brute.bottleneck_s <= plan.bottleneck_s * (1 + REL) + 1e-12


@settings(max_examples=25, deadline=None)
@given(cases(max_layers=4, max_devices=3), st.floats(0.5, 20.0))
def test_dp_is_optimal_on_homogeneous_links(case, bw):
    # With equal links every device subset and ring order costs the same as a run.
    p, _ = case
    t = Topology.homogeneous(3, bw)
    assert plan_pipeline(p, t).bottleneck_s == pytest.approx(
        plan_bruteforce(p, t).bottleneck_s, rel=REL, abs=1e-12)


def test_bruteforce_can_beat_the_bandwidth_order():
    # Totals order the devices (2, 1, 0), so runs chain 2 -> 1 -> 0 and the big activation of
    # layer 1 would cross the 1-bandwidth link 1 -> 0; the best chain is 0 -> 1 -> 2.  The
    # heuristic's gap is reported here, not required to be zero.
    t = Topology([[0, 1, 2], [1, 0, 10], [2, 10, 0]])
    p = prof([2.0, 2.0, 2.0], act=[0, 10, 40], params=[20, 0, 20])
    plan, brute = plan_pipeline(p, t), plan_bruteforce(p, t)
    assert plan.device_order == (2, 1, 0)
    assert plan.bottleneck_s == pytest.approx(4.0) == plan_exhaustive(p, t).bottleneck_s
    assert brute.bottleneck_s == pytest.approx(3.0)
    assert [s.devices for s in brute.stages] == [(0,), (1,), (2,)]


def test_pipeline_modules_do_not_import_tensorflow():
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('tf_blocksparse'); pkg.__path__ = [{str(PLANNING.parent)!r}]\n"
        "sys.modules['tf_blocksparse'] = pkg\n"
        "import tf_blocksparse.planning as P\n"
        "p = P.random_profile(20); t = P.Topology.random_heterogeneous(4, 1e9)\n"
        "P.simulate_pipeline(p, t, P.plan_pipeline(p, t), 4, '1f1b')\n"
        "P.compare_pipeline_plans(p, t)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
