"""The automatic exchange's measurements on two real MirroredStrategy replicas."""

import numpy as np
import pytest
import tensorflow as tf

from tf_blocksparse import blocks
from tf_blocksparse.distribute import link_probe
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.keras.auto_exchange import ExchangeChooser
from tf_blocksparse.planning.exchange_cost import AutoExchange


def _comp(*shapes, dense_below=0):
    lays = [blocks.BlockLayout(f"w{i}", s, blocks.OUTPUT_CHANNEL, None)
            for i, s in enumerate(shapes)]
    return BlockTopK(lays, k=1, dense_below=dense_below)


def test_compression_probe_times_each_group_and_creates_no_state(mirrored2):
    comps = [_comp((64, 32), (32,)), None, _comp((8, 4), dense_below=100)]
    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    # no variables: under the scope they would be mirrored, timing the strategy's work
    with mirrored2.scope(), tf.variable_creator_scope(creator):
        seconds = link_probe.time_compression(comps, [["float32", "float32"], [], ["float32"]],
                                              repeats=3)
    assert seconds[0] > 0 and seconds[1:] == [0.0, 0.0]
    assert created == []


def test_collective_probes_and_agreement(mirrored2):
    with mirrored2.scope():
        sums, gathers = link_probe.time_collectives(mirrored2, [1024, 65536], 2)
        assert len(sums) == len(gathers) == 2
        assert all(np.isfinite(s) and s > 0 for s in sums + gathers)
        assert link_probe.agree_mean(mirrored2, [1.0, 3.0]) == [1.0, 3.0]
        assert link_probe.from_first_replica(mirrored2, [2, 0, 1]) == [2, 0, 1]
        traced = len(link_probe._AGREE)  # lengths up to 8 share one function per kind
        assert link_probe.agree_mean(mirrored2, [0.5] * 7) == [0.5] * 7
        assert len(link_probe._AGREE) == traced
        assert link_probe.agree_mean(mirrored2, [2.0] * 9) == [2.0] * 9  # padded to 16
        assert len(link_probe._AGREE) == traced + 1


def test_probes_grow_until_the_time_or_the_cap(mirrored2):
    with mirrored2.scope():
        sizes, times = link_probe.grown_probes(mirrored2, [64, 256], 1, "sum", 10.0, 9000)
        assert sizes == [64, 256, 1024, 4096, 9000] and len(times) == 5  # capped at 9000
        sizes, _ = link_probe.grown_probes(mirrored2, [64, 256], 1, "sum", 10.0, 5000)
        assert sizes == [64, 256, 1024, 4096]  # 5000 would add < 2x: not worth a trace
        sizes, _ = link_probe.grown_probes(mirrored2, [64, 256], 1, "gather", 0.0, 5000)
        assert sizes == [64, 256]  # every probe already took >= 0 s


def test_a_re_measurement_reuses_the_traced_probes(mirrored2):
    comps, dtypes, cache = [_comp((64, 32))], [["float32"]], {}
    with mirrored2.scope():
        link_probe.time_compression(comps, dtypes, repeats=1, cache=cache)
        (probe,) = cache.values()
        link_probe.time_compression(comps, dtypes, repeats=1, cache=cache)
        assert list(cache.values()) == [probe]


@pytest.mark.parametrize("policy,timed", [
    (AutoExchange(convergence_cost=100.0), False),  # sparse cannot win: nothing to time
    (AutoExchange(candidates=("allgather",)), True)])
def test_compression_is_timed_only_where_a_sparse_mode_could_win(mirrored2, policy, timed):
    comps = [_comp((64, 32)), _comp((32, 16))]
    chooser = ExchangeChooser(policy, mirrored2, [[0], [1]], comps, [["float32"]] * 2)
    decision = chooser.decide(compute_s=0.01)
    assert bool(chooser._probe_cache) == timed
    assert (decision.compress_s > 0) == timed
    assert all(g.compress_s == 0 for g in decision.groups) != timed
