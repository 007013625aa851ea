"""Pipeline planner baselines (SPEC S3): PipeDream's DP, the oblivious split, the comparison."""

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
    plan_bruteforce,
    plan_oblivious,
    plan_pipedream,
    plan_pipeline,
    random_profile,
    synthetic_profile,
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
    plan = plan_pipedream(p, t)
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
    # Ids interleave the hosts, so id-ordered placements cross the slow inter-host link at
    # every cut while the bandwidth order keeps neighbours on one host.
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
    assert dp < pd and dp < ob
    assert compare_pipeline_plans(p, t, [plan_oblivious(p, t)])[0]["method"] == "oblivious"
