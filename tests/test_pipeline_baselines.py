"""Pipeline planner baselines: PipeDream's DP, the oblivious split, the comparison."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse.planning import (
    LayerProfile,
    ModelProfile,
    Topology,
    compare_pipeline_plans,
    pipedream_levels,
    plan_bruteforce,
    plan_oblivious,
    plan_pipedream,
    plan_pipeline,
    random_profile,
    synthetic_profile,
    two_level,
)

FAST = settings(max_examples=40, deadline=None)


def prof(compute, act=None, params=None):
    act = act if act is not None else [0] * len(compute)
    params = params if params is not None else [0] * len(compute)
    return ModelProfile([LayerProfile(f"l{i}", c, a, p)
                         for i, (c, a, p) in enumerate(zip(compute, act, params))])


def pipedream_objective(p, ranges, reps, bw):
    """PipeDream's own model of a straight pipeline: max of stage times and cut transfers."""
    worst = 0.0
    for k, ((i, j), m) in enumerate(zip(ranges, reps)):
        comp = sum(x.compute_s for x in p.layers[i:j + 1])
        par = sum(x.param_bytes for x in p.layers[i:j + 1])
        worst = max(worst, comp / m + 4 * (m - 1) * par / (m * bw))
        if k:
            worst = max(worst, 2 * p.layers[i - 1].activation_bytes / bw)
    return worst


def best_pipedream_objective(p, num_devices, bw):
    n, best = p.num_layers, math.inf
    for cuts_n in range(n):
        for cuts in itertools.combinations(range(1, n), cuts_n):
            edges = [0, *cuts, n]
            ranges = [(a, b - 1) for a, b in zip(edges, edges[1:])]
            for reps in itertools.product(range(1, num_devices + 1), repeat=len(ranges)):
                if sum(reps) <= num_devices:
                    best = min(best, pipedream_objective(p, ranges, reps, bw))
    return best


@st.composite
def cases(draw, max_layers=5, max_devices=4):
    n = draw(st.integers(1, max_layers))
    d = draw(st.integers(1, max_devices))
    layers = [LayerProfile(f"l{i}", draw(st.floats(0.0, 5.0)), draw(st.integers(0, 40)),
                           draw(st.integers(0, 40))) for i in range(n)]
    m = [[0.0] * d for _ in range(d)]
    for a in range(d):
        for b in range(a):
            m[a][b] = m[b][a] = draw(st.floats(1.0, 20.0))
    return ModelProfile(layers), Topology(m)


@FAST
@given(cases())
def test_pipedream_solves_its_own_recurrence(case):
    p, t = case
    plan = plan_pipedream(p, t, level_bandwidth="mean")  # the one-level form on any topology
    plan.validate(p, t)  # evaluated with the shared cost model
    assert plan.method == "pipedream"
    # Stage k gets the next device ids in id order.
    assert plan.devices_used == tuple(range(len(plan.devices_used)))
    bw = t.mean_bandwidth() if t.num_devices > 1 else 1.0
    ranges = [(s.first_layer, s.last_layer) for s in plan.stages]
    got = pipedream_objective(p, ranges, [s.replicas for s in plan.stages], bw)
    assert got == pytest.approx(best_pipedream_objective(p, t.num_devices, bw), rel=1e-9,
                                abs=1e-12)


def test_pipedream_by_hand_and_level_bandwidth():
    t = Topology([[0, 1, 3], [1, 0, 2], [3, 2, 0]])
    # No parameters, no activations: one stage on every worker (fewer stages on ties).
    plan = plan_pipedream(prof([1.0, 1.0]), t)
    assert [(s.first_layer, s.last_layer, s.devices) for s in plan.stages] == [(0, 1, (0, 1, 2))]
    # Heavy parameters forbid replication: one worker per stage.
    plan = plan_pipedream(prof([1.0, 1.0], act=[0, 0], params=[100, 100]), t)
    assert [(s.first_layer, s.last_layer, s.devices) for s in plan.stages] == \
        [(0, 0, (0,)), (1, 1, (1,))]
    # The level bandwidth only changes PipeDream's decisions, and must be valid.
    p = random_profile(8, seed=1)
    for level in ("mean", "min", 1e6):
        plan_pipedream(p, t, level_bandwidth=level).validate(p, t)
    for bad in ("max", 0.0, math.inf):
        with pytest.raises(ValueError, match="level_bandwidth"):
            plan_pipedream(p, t, level_bandwidth=bad)


def test_oblivious_split_balances_compute():
    p = prof([4.0, 1.0, 1.0, 1.0, 1.0, 4.0])
    t = Topology.homogeneous(3, 1.0)
    plan = plan_oblivious(p, t)
    assert plan.method == "oblivious" and plan.devices_used == (0, 1, 2)
    assert [(s.first_layer, s.last_layer) for s in plan.stages] == [(0, 0), (1, 4), (5, 5)]
    assert [s.devices for s in plan_oblivious(p, t, num_stages=2).stages] == [(0,), (1,)]
    assert plan_oblivious(prof([1.0, 2.0]), Topology.homogeneous(5, 1.0)).num_stages == 2
    for bad in (0, 4, 1.5, True):
        with pytest.raises(ValueError, match="num_stages"):
            plan_oblivious(p, t, num_stages=bad)


@FAST
@given(cases(max_layers=6))
def test_oblivious_minimises_the_largest_stage_compute(case):
    p, t = case
    plan = plan_oblivious(p, t)
    plan.validate(p, t)
    k = min(p.num_layers, t.num_devices)
    assert plan.num_stages == k and all(s.replicas == 1 for s in plan.stages)
    c = [x.compute_s for x in p.layers]
    best = min(max(sum(c[a:b]) for a, b in zip((0, *cuts), (*cuts, len(c))))
               for cuts in itertools.combinations(range(1, len(c)), k - 1))
    assert max(s.compute_s for s in plan.stages) == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(cases(max_layers=4, max_devices=3), st.floats(1.0, 20.0))
def test_bandwidth_dp_beats_baselines_on_homogeneous_links(case, bw):
    # There the DP is optimal over every placement (see test_pipeline_planner), so no
    # baseline, evaluated with the same model, can be better.
    p, _ = case
    t = Topology.homogeneous(3, bw)
    dp = plan_pipeline(p, t).bottleneck_s
    assert dp == pytest.approx(plan_bruteforce(p, t).bottleneck_s, rel=1e-9, abs=1e-12)
    for other in (plan_pipedream(p, t), plan_oblivious(p, t)):
        assert dp <= other.bottleneck_s * (1 + 1e-9) + 1e-12


def test_compare_pipeline_plans_on_a_two_level_cluster():
    # Ids interleave the hosts, so id-ordered placements (the oblivious split, PipeDream's
    # one-level form) cross the slow inter-host link at every cut; the DP's gaps and
    # PipeDream's hierarchy detection keep neighbours on one host.
    t = Topology([[0, 1, 50, 1], [1, 0, 1, 50], [50, 1, 0, 1], [1, 50, 1, 0]])
    p = synthetic_profile("uniform", 8, activation_bytes=20.0, param_bytes=100.0,
                          layer_compute_s=1.0, jitter=0.0)
    rows = compare_pipeline_plans(p, t)
    assert [r["method"] for r in rows] == ["bandwidth_dp", "pipedream", "oblivious"]
    for r in rows:
        assert set(r) == {"method", "stages", "devices_used", "devices", "bottleneck_s",
                          "throughput"}
        assert r["throughput"] == pytest.approx(1 / r["bottleneck_s"])
        assert r["devices_used"] == len(r["devices"])
    dp, pd, ob = (r["bottleneck_s"] for r in rows)
    assert dp <= pd * (1 + 1e-12) and dp < ob
    assert pipedream_levels(t)[0] == (0, 2, 1, 3)
    assert dp < plan_pipedream(p, t, level_bandwidth="mean").bottleneck_s
    assert compare_pipeline_plans(p, t, [plan_oblivious(p, t)])[0]["method"] == "oblivious"


# Stage spans of the one-level PipeDream before the hierarchical form was added:
# random_profile(9, seed, param_bytes=(1e2, 1e5), activation_bytes=(1e5, 1e6)) on
# Topology.random_heterogeneous(6, 1e9, seed=seed).
ONE_LEVEL_BEFORE = {
    0: [(0, 1, (0,)), (2, 8, (1, 2, 3, 4, 5))],
    1: [(0, 2, (0, 1)), (3, 5, (2, 3)), (6, 8, (4, 5))],
    2: [(0, 5, (0, 1, 2, 3, 4)), (6, 8, (5,))],
    3: [(0, 2, (0, 1)), (3, 3, (2,)), (4, 8, (3, 4, 5))],
}


def spans(plan):
    return [(s.first_layer, s.last_layer, s.devices) for s in plan.stages]


@pytest.mark.parametrize("seed", sorted(ONE_LEVEL_BEFORE))
def test_pipedream_one_level_equals_the_previous_behaviour(seed):
    p = random_profile(9, seed=seed, param_bytes=(1e2, 1e5), activation_bytes=(1e5, 1e6))
    t = Topology.random_heterogeneous(6, 1e9, seed=seed)
    assert t.hierarchy() is None  # random links: flat, so the default is the one-level form
    plan = plan_pipedream(p, t)
    assert spans(plan) == ONE_LEVEL_BEFORE[seed]
    assert plan == plan_pipedream(p, t, level_bandwidth="mean") == \
        plan_pipedream(p, t, levels=[(6, t.mean_bandwidth())])


def test_pipedream_one_level_form_on_a_two_level_cluster():
    # What the one-level planner did on this cluster (mean bandwidth, id order).
    p, t = random_profile(10, seed=7), two_level(2, 3, 1e10, 1e9)
    assert spans(plan_pipedream(p, t, level_bandwidth="mean")) == \
        [(0, 4, (0, 1, 2)), (5, 5, (3,)), (6, 7, (4,)), (8, 9, (5,))]
    assert plan_pipedream(p, t, levels=[(6, t.mean_bandwidth())]) == \
        plan_pipedream(p, t, level_bandwidth="mean")


def test_pipedream_two_levels_by_hand():
    # Two nodes of two devices: B_1 = 100 inside a node, B_2 = 10 across.  Layers: compute 4
    # each, parameters 1 byte each, layer 0 outputs 50 bytes.
    t = two_level(2, 2, 100.0, 10.0)
    p = prof([4.0, 4.0], act=[50, 0], params=[1, 1])
    assert pipedream_levels(t) == ((0, 1, 2, 3), ((2, 100.0), (2, 10.0)))
    # Level 1 (one node): A1(0..0) = min(4, 4/2 + 4*1*1/(2*100)) = 2.02 = A1(1..1);
    # A1(0..1) = min(T(1) = 8, T(2) = 4 + 4*2/200 = 4.04, split max(4, 2*50/100, 4) = 4) = 4
    # (layer 0 on the node's first device, layer 1 on its second).
    # Level 2: T2(0..1, 1) = 4, T2(0..1, 2) = 4/2 + 4*1*2/(2*10) = 2.4, split
    # max(2.02, 2*50/10 = 10, 2.02) = 10: one top stage on both nodes, each running the split.
    plan = plan_pipedream(p, t)
    assert spans(plan) == [(0, 0, (0, 2)), (1, 1, (1, 3))]
    # Shared cost model: stage 0 = 4/2 + 2*(1/2)*1/10 = 2.1; stage 1 receives from device 2
    # on device 1 (inter-node): 4/2 + 50/10 + 0.1 = 7.1.
    assert [s.time_s for s in plan.stages] == pytest.approx([2.1, 7.1])
    assert plan.bottleneck_s == pytest.approx(7.1)
    assert plan_pipedream(p, t, levels=[(2, 100.0), (2, 10.0)]) == plan
    # One level at the mean bandwidth (40) decides differently: one stage on all devices.
    assert spans(plan_pipedream(p, t, level_bandwidth="mean")) == [(0, 1, (0, 1, 2, 3))]
    assert plan_pipeline(p, t).bottleneck_s < plan.bottleneck_s


def test_pipedream_three_levels_and_bad_levels():
    # 2 racks x 2 nodes x 2 devices, ids interleaved: node (rack r, node k) = {2k + r, 2k + r + 4}.
    rack, node = [0, 1, 0, 1, 0, 1, 0, 1], [0, 0, 1, 1, 0, 0, 1, 1]
    bw = [[0.0 if a == b else 100.0 if (rack[a], node[a]) == (rack[b], node[b]) else
           10.0 if rack[a] == rack[b] else 1.0 for b in range(8)] for a in range(8)]
    t = Topology(bw)
    order, levels = pipedream_levels(t)
    assert order == (0, 4, 2, 6, 1, 5, 3, 7) and levels == ((2, 100.0), (2, 10.0), (2, 1.0))
    p = random_profile(7, seed=3, param_bytes=(1e2, 1e4), activation_bytes=(1e2, 1e3))
    plan = plan_pipedream(p, t)
    plan.validate(p, t)
    assert plan.device_order == order
    for bad in ([(0, 1.0)], [(2, 0.0)], [(2, math.inf)], [(3, 1.0), (3, 1.0)], [(2,)], [],
                [(2.5, 1.0)], 3):
        with pytest.raises(ValueError, match="levels"):
            plan_pipedream(p, t, levels=bad)
    with pytest.raises(ValueError, match="level_bandwidth and levels"):
        plan_pipedream(p, t, level_bandwidth="mean", levels=[(8, 1.0)])


@st.composite
def two_level_cases(draw):
    nodes, per_node = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    inter = draw(st.sampled_from([1.0, 2.0]) | st.floats(0.5, 20.0))
    intra = inter * draw(st.sampled_from([1.0, 10.0]) | st.floats(1.0, 50.0))
    n = draw(st.integers(1, 5))
    layers = [LayerProfile(f"l{i}", draw(st.floats(0.0, 5.0)), draw(st.integers(0, 60)),
                           draw(st.integers(0, 60))) for i in range(n)]
    return ModelProfile(layers), two_level(nodes, per_node, intra, inter)


@settings(max_examples=60, deadline=None)
@given(two_level_cases())
def test_bandwidth_dp_never_worse_than_pipedream_on_hierarchies(case):
    # On a uniform hierarchy with nodes of consecutive ids every device has the same total
    # bandwidth, so the DP searches runs of the id order, and every hierarchical PipeDream
    # placement can be re-laid out as such runs without a slower link.
    p, t = case
    pd = plan_pipedream(p, t)
    pd.validate(p, t)
    assert set(pd.devices_used) <= set(range(t.num_devices))
    assert plan_pipeline(p, t).bottleneck_s <= pd.bottleneck_s * (1 + 1e-9) + 1e-12
