"""The automatic exchange's policy and cost model (pure Python)."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tf_blocksparse.options import CompressionOptions
from tf_blocksparse.planning.exchange_cost import (
    AutoExchange,
    GroupCost,
    LinkCost,
    exchange_seconds,
    mode_seconds,
)

SLOW = LinkCost(1e-3, 8 / 100e6, 1e-3, 3 * 8 / 100e6)  # ~100 Mbit/s, 4 workers' gathers
FREE = LinkCost(0.0, 0.0, 0.0, 0.0)
BIG = GroupCost(dense_bytes=12_000_000, whole_bytes=0, id_bytes=4 * 1001, value_bytes=600_000,
                score_bytes=4 * 1000, compress_s=0.004)


def test_link_fit_recovers_a_line_and_clamps():
    sizes = [1000, 5000, 9000]
    link = LinkCost.fit(sizes, [1e-3 + 2e-9 * s for s in sizes], [5e-4 + 1e-8 * s for s in sizes])
    assert link.sum_latency_s == pytest.approx(1e-3)
    assert link.sum_s_per_byte == pytest.approx(2e-9)
    assert link.gather_latency_s == pytest.approx(5e-4)
    assert link.gather_s_per_byte == pytest.approx(1e-8)
    falling = LinkCost.fit([10, 20], [2.0, 1.0], [1.0, 3.0])  # noise: a negative slope
    assert falling.sum_s_per_byte == 0.0 and falling.sum_latency_s == pytest.approx(1.5)
    with pytest.raises(ValueError, match="sizes"):
        LinkCost.fit([10, 10], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="sum_latency_s"):
        LinkCost(-1.0, 0.0, 0.0, 0.0)


def test_mode_seconds_by_hand():
    link = LinkCost(1.0, 0.5, 2.0, 0.25)
    g = GroupCost(dense_bytes=100, whole_bytes=10, id_bytes=8, value_bytes=20,
                  score_bytes=12, compress_s=3.0)
    assert mode_seconds(link, g, "dense") == 1.0 + 50.0
    assert mode_seconds(link, g, "allgather") == 3.0 + (1 + 5) + (2 + 2) + (2 + 5)
    assert mode_seconds(link, g, "shared") == 3.0 + (1 + 5) + (1 + 6) + (1 + 10)
    only_whole = GroupCost(dense_bytes=10, whole_bytes=10)
    assert mode_seconds(link, only_whole, "allgather") == 1.0 + 5.0
    assert mode_seconds(link, GroupCost(0), "dense") == 0.0
    with pytest.raises(ValueError, match="mode"):
        mode_seconds(link, g, "auto")


def test_slow_link_goes_sparse_fast_link_stays_dense():
    policy = AutoExchange()
    assert policy.decide(SLOW, [BIG], compute_s=0.1).modes == ("shared",)  # gathers cost 3x
    assert policy.decide(FREE, [BIG], compute_s=0.1).modes == ("dense",)
    small = GroupCost(dense_bytes=4000, whole_bytes=0, id_bytes=8, value_bytes=200,
                      score_bytes=40, compress_s=0.002)
    mixed = policy.decide(SLOW, [BIG, small], compute_s=0.1)
    assert mixed.modes == ("shared", "dense")  # compressing 4 KB costs more than it saves
    assert mixed.objective_s <= mixed.dense_objective_s
    assert mixed.summary()["auto_sparse_groups"] == 1.0


def test_convergence_cost_can_tip_the_choice():
    # sparse halves a 0.3 s step's exchange, but a sparse run needs more steps
    link = LinkCost(0.0, 1e-8, 0.0, 1e-8)
    g = GroupCost(dense_bytes=10_000_000, id_bytes=8, value_bytes=5_000_000, score_bytes=8)
    assert AutoExchange(convergence_cost=0.0).decide(link, [g], 0.2).modes == ("allgather",)
    assert AutoExchange(convergence_cost=1.0).decide(link, [g], 0.2).modes == ("dense",)


def test_convergence_cost_per_mode_weighs_allgather_against_shared():
    # shared's step is 10% shorter, but with fewer blocks per step it needs more steps
    link = LinkCost(0.0, 1e-9, 0.0, 1.1e-9)
    g = GroupCost(dense_bytes=400_000_000, id_bytes=40_000, value_bytes=20_000_000,
                  score_bytes=400_000)
    per_mode = AutoExchange(convergence_cost={"allgather": 0.5, "shared": 0.8})
    assert per_mode.decide(link, [g], 0.01).modes == ("allgather",)
    assert AutoExchange(convergence_cost=0.5).decide(link, [g], 0.01).modes == ("shared",)
    assert per_mode == AutoExchange() and hash(per_mode) == hash(AutoExchange())
    assert per_mode.convergence_cost_of("shared") == 0.8
    assert per_mode.convergence_cost_of("dense") == 0.0
    one = AutoExchange(convergence_cost={"shared": 1.0})  # the other keeps its default
    assert (one.convergence_cost_of("allgather"), one.convergence_cost_of("shared")) == \
        (0.5, 1.0)
    assert AutoExchange.from_config(one.get_config()) == one
    assert one.get_config()["convergence_cost"] == {"allgather": 0.5, "shared": 1.0}


def test_recurrent_layers_stay_dense_unless_given_a_cost():
    """A sparse step 1.56x (or 10x) faster: worth it for convolutions and dense layers, never
    by default for a group delaying a recurrent layer's bytes; with ``recurrent_cost=3`` only
    where a sparse step is more than 1 + 0.5 * (0.96 + 2 * 0.77) = 2.25x faster (gru_nmt's
    measured 2.26x dense's epochs)."""
    link = LinkCost(0.0, 1e-8, 0.0, 1e-8)
    kw = {"dense_bytes": 191_808, "whole_bytes": 7_680, "id_bytes": 40, "value_bytes": 1_600}
    conv, gru = GroupCost(**kw), GroupCost(**kw, recurrent_bytes=147_456)
    dense_step, sparse_step = (mode_seconds(link, conv, m) for m in ("dense", "allgather"))

    def compute_for(speedup):  # the compute that makes a sparse step `speedup` x faster
        return (dense_step - speedup * sparse_step) / (speedup - 1)

    policy = AutoExchange()
    assert policy.recurrent_cost is None
    for speedup in (1.56, 10.0):
        assert policy.decide(link, [conv], compute_for(speedup)).modes == ("allgather",)
        assert policy.decide(link, [gru], compute_for(speedup)).modes == ("dense",)
    # with other groups: only the one holding the recurrent layer stays dense
    d = policy.decide(link, [conv, gru, conv], compute_for(10.0))
    assert d.modes == ("allgather", "dense", "allgather")
    assert policy.stays_dense([gru, gru]) and not policy.stays_dense([conv, gru])
    assert not AutoExchange(recurrent_cost=3.0).stays_dense([gru])
    assert not AutoExchange(candidates=("allgather", "shared")).stays_dense([gru])
    # a finite cost: 3.0 weighs the GRU's 77% of the bytes three times
    three = AutoExchange(recurrent_cost=3.0)
    assert three.decide(link, [gru], compute_for(1.56)).modes == ("dense",)
    assert three.decide(link, [gru], compute_for(2.4)).modes == ("allgather",)
    sparse = three.decision_for(link, [gru], compute_for(1.56), ["allgather"])
    assert sparse.objective_s / sparse.step_s == pytest.approx(
        1 + 0.5 * (184_128 + 2 * 147_456) / 191_808)
    assert sparse.dense_step_s / sparse.step_s == pytest.approx(1.56)
    same = AutoExchange(recurrent_cost=1.0)  # a recurrent layer's delay is any layer's
    assert same.decide(link, [gru], compute_for(1.56)).modes == ("allgather",)
    assert same.weighted_delay(gru) == gru.delayed_bytes == 184_128
    # nothing to avoid without a dense candidate; a zero convergence cost ignores delay
    assert AutoExchange(candidates=("allgather",)).decide(
        link, [gru], compute_for(1.56)).modes == ("allgather",)
    assert AutoExchange(convergence_cost=0.0).decide(
        link, [gru], compute_for(1.56)).modes != ("dense",)
    for p in (three, same, policy):
        assert AutoExchange.from_config(p.get_config()) == p
    legacy = {k: v for k, v in AutoExchange().get_config().items() if k != "recurrent_cost"}
    assert AutoExchange.from_config(legacy) == AutoExchange()  # configs saved before it
    with pytest.raises(ValueError, match="recurrent_bytes"):
        GroupCost(dense_bytes=100, whole_bytes=60, recurrent_bytes=41)


def test_compute_prior_stands_in_for_the_unmeasured_compute():
    # without compute, shared's faster exchange wins; with the prior (30x the compression
    # time) allgather's fewer extra steps outweigh it, as with the compute measured later
    link = LinkCost(0.0, 1e-9, 0.0, 2e-9)
    g = GroupCost(dense_bytes=400_000_000, id_bytes=40_000, value_bytes=20_000_000,
                  score_bytes=400_000, compress_s=0.012)
    policy = AutoExchange()
    assert policy.prior_compute_s([g, g]) == pytest.approx(30 * 0.024)
    assert policy.decide(link, [g], 0.0).modes == ("shared",)
    assert policy.decide(link, [g], policy.prior_compute_s([g])).modes == ("allgather",)
    assert AutoExchange(compute_prior=0.0).prior_compute_s([g]) == 0.0
    assert AutoExchange.from_config(AutoExchange(compute_prior=2.0).get_config()) == \
        AutoExchange(compute_prior=2.0)


def test_link_fit_takes_separate_gather_sizes():
    link = LinkCost.fit([1000, 5000, 9000], [0.002, 0.006, 0.010], [0.001, 0.003],
                        gather_sizes=[100, 300])
    assert link.sum_latency_s == pytest.approx(0.001)
    assert link.sum_s_per_byte == pytest.approx(1e-6)
    assert link.gather_latency_s == pytest.approx(0.0, abs=1e-12)
    assert link.gather_s_per_byte == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="gather_sizes"):
        LinkCost.fit([1, 2], [1.0, 2.0], [1.0], gather_sizes=[1])


def test_candidates_and_hysteresis():
    assert AutoExchange(candidates=("dense",)).decide(SLOW, [BIG]).modes == ("dense",)
    assert AutoExchange(candidates=("shared",)).pinned and not AutoExchange().pinned
    assert AutoExchange(candidates=("shared",)).decide(FREE, [BIG]).modes == ("shared",)
    near = AutoExchange(hysteresis=0.99)
    assert near.decide(SLOW, [BIG], 0.1, current=["dense"]).modes == ("dense",)
    assert AutoExchange(hysteresis=0.0).decide(SLOW, [BIG], 0.1,
                                               current=["dense"]).modes == ("shared",)
    assert near.decide(SLOW, [BIG], 0.1, current=["dense"],
                       hysteresis=False).modes == ("shared",)


def test_decision_for_given_modes_prices_them_as_decide_does():
    policy = AutoExchange()
    chosen = policy.decide(SLOW, [BIG, BIG], 0.1)
    assert policy.decision_for(SLOW, [BIG, BIG], 0.1, chosen.modes) == chosen
    forced = policy.decision_for(SLOW, [BIG, BIG], 0.1, ["dense", "dense"])
    assert forced.modes == ("dense", "dense") and forced.step_s == chosen.dense_step_s
    for bad in (["dense"], ["dense", "sparse"]):
        with pytest.raises(ValueError, match="modes"):
            policy.decision_for(SLOW, [BIG, BIG], 0.1, bad)


def test_a_switch_must_pay_for_its_retrace():
    policy = AutoExchange(hysteresis=0.0)
    free = policy.decide(SLOW, [BIG], 0.1)
    assert free.modes == ("shared",)
    dense = policy.decide(SLOW, [BIG], 0.1, ["dense"], hysteresis=False).dense_objective_s
    dense_step = policy.decide(SLOW, [BIG], 0.1, ["dense"]).dense_step_s
    # switching saves steps_left * dense_step * (1 - new / old) seconds
    per_step = dense_step * (1 - free.objective_s / dense)
    for steps_left, switch_s, modes in ((None, 1e9, "shared"), (0, 0.0, "dense"),
                                        (10, 9.9 * per_step, "shared"),
                                        (10, 10.1 * per_step, "dense")):
        got = policy.decide(SLOW, [BIG], 0.1, ["dense"], switch_s=switch_s,
                            steps_left=steps_left)
        assert got.modes == (modes,), (steps_left, switch_s)
    for bad in ({"switch_s": -1.0}, {"steps_left": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            policy.decide(SLOW, [BIG], 0.1, **bad)


@pytest.mark.parametrize("kwargs,name", [
    ({"candidates": ("dense", "sparse")}, "candidates"), ({"candidates": ()}, "candidates"),
    ({"candidates": "dense"}, "candidates"), ({"convergence_cost": -1}, "convergence_cost"),
    ({"convergence_cost": {"dense": 0.1}}, "convergence_cost"),
    ({"convergence_cost": {"shared": -0.1}}, "convergence_cost\\['shared'\\]"),
    ({"probe_bytes": (1024,)}, "probe_bytes"), ({"probe_bytes": (2, 1024)}, "probe_bytes"),
    ({"probe_repeats": 0}, "probe_repeats"), ({"probe_seconds": -1.0}, "probe_seconds"),
    ({"warmup_steps": 0}, "warmup_steps"),
    ({"remeasure_steps": -1}, "remeasure_steps"), ({"hysteresis": 1.0}, "hysteresis"),
    ({"measure_budget": 0.0}, "measure_budget"), ({"measure_budget": 1.5}, "measure_budget"),
    ({"measure_budget": float("nan")}, "measure_budget"),
    ({"compute_prior": -1.0}, "compute_prior"), ({"compute_prior": True}, "compute_prior"),
    ({"recurrent_cost": -0.5}, "recurrent_cost"),
    ({"recurrent_cost": float("inf")}, "recurrent_cost"),
])
def test_bad_policy_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AutoExchange(**kwargs)


def test_options_take_auto_and_round_trip():
    opts = CompressionOptions(exchange="auto", density=0.05)
    assert opts.auto and opts.sparse and opts.exchange == AutoExchange()
    assert opts.get_config()["exchange"] == "auto"
    custom = opts.replace(exchange=AutoExchange(candidates=("dense", "shared"),
                                                convergence_cost=0.2))
    config = custom.get_config()
    assert config["exchange"] == {"auto": custom.exchange.get_config()}
    assert CompressionOptions.from_config(config) == custom
    assert not CompressionOptions(exchange="shared").auto
    with pytest.raises(ValueError, match="exchange"):
        CompressionOptions(exchange="automatic")
    with pytest.raises(ValueError, match="AutoExchange does not take"):
        CompressionOptions(exchange={"auto": {"speed": 1}})


_groups = st.lists(st.builds(
    lambda d, w, v, c, r: GroupCost(dense_bytes=d, whole_bytes=min(w, d), id_bytes=8,
                                    value_bytes=v, score_bytes=64, compress_s=c,
                                    recurrent_bytes=int(r * (d - min(w, d)))),
    st.integers(1, 10**7), st.integers(0, 10**6), st.integers(0, 10**6),
    st.floats(0, 0.05), st.sampled_from([0.0, 0.0, 0.5, 1.0])), min_size=1, max_size=6)
_links = st.builds(LinkCost, st.floats(0, 1e-2), st.floats(0, 1e-7), st.floats(0, 1e-2),
                   st.floats(0, 1e-7))


@settings(max_examples=200, deadline=None)
@given(_links, _groups, st.floats(0, 1.0), st.floats(0, 2.0),
       st.one_of(st.none(), st.floats(0, 5.0)))
def test_choice_is_never_predicted_worse_than_all_dense_or_all_sparse(link, groups, compute,
                                                                      cost, recurrent):
    policy = AutoExchange(convergence_cost=cost, hysteresis=0.0, recurrent_cost=recurrent)
    weight = float("inf") if recurrent is None else recurrent
    d = policy.decide(link, groups, compute)
    total = sum(g.dense_bytes for g in groups)
    for modes in (["dense"] * len(groups), ["allgather"] * len(groups),
                  ["shared"] * len(groups)):
        step = compute + exchange_seconds(link, groups, modes)
        delayed = sum(0.0 if not cost else
                      g.delayed_bytes + (weight - 1) * g.recurrent_bytes if g.recurrent_bytes
                      else g.delayed_bytes for g, m in zip(groups, modes) if m != "dense")
        assert d.objective_s <= step * (1 + cost * delayed / total) * (1 + 1e-9)
    assert d.objective_s <= d.dense_objective_s * (1 + 1e-9)
    assert d.step_s >= compute


def test_adjacent_groups_of_one_mode_pay_one_latency():
    link = LinkCost(1.0, 0.0, 2.0, 0.0)
    g = GroupCost(dense_bytes=100, id_bytes=8, value_bytes=20, score_bytes=12)
    assert exchange_seconds(link, [g, g, g], ["dense"] * 3) == 1.0
    assert exchange_seconds(link, [g, g], ["allgather", "allgather"]) == 2 * 2.0
    assert exchange_seconds(link, [g, g, g], ["dense", "shared", "dense"]) == 1 + 2 + 1
    # many small groups: sparse everywhere is one set of collectives, not one per group
    small = GroupCost(dense_bytes=40_000, id_bytes=8, value_bytes=2_000, score_bytes=400,
                      compress_s=1e-4)
    slow = LinkCost(5e-3, 8 / 100e6, 5e-3, 3 * 8 / 100e6)
    d = AutoExchange(convergence_cost=0.0).decide(slow, [small] * 8, compute_s=0.1)
    assert set(d.modes) == {"shared"}
