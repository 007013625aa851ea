"""The automatic exchange's measurements on two real MirroredStrategy replicas."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_blocksparse import blocks
from tf_blocksparse.auto import link_probe
from tf_blocksparse.auto.auto_exchange import ExchangeChooser
from tf_blocksparse.feedback import BlockTopK
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
        probes = [("sum", 1024), ("sum", 65536), ("gather", 1024), ("gather", 65536)]
        seconds = link_probe.time_collectives(mirrored2, probes, 2)
        assert len(seconds) == 4 and all(np.isfinite(s) and s > 0 for s in seconds)
        probe = link_probe._PROBES[id(mirrored2)]
        # other sizes, one kind alone: the same function, traced once, nothing set up again
        link_probe.time_collectives(mirrored2, [("gather", 4096), ("sum", 8), ("sum", 12)], 1)
        assert link_probe._PROBES[id(mirrored2)] is probe
        assert probe.function.experimental_get_tracing_count() == 1
        assert link_probe.agree_mean(mirrored2, [1.0, 3.0]) == [1.0, 3.0]
        traced = len(link_probe._AGREE)
        # lengths up to 8 share one function: means, replica 0's values and the barrier
        assert link_probe.from_first_replica(mirrored2, [2, 0, 1]) == [2, 0, 1]
        link_probe.barrier(mirrored2)
        assert link_probe.agree_mean(mirrored2, [0.5] * 7) == [0.5] * 7
        assert len(link_probe._AGREE) == traced
        agree = link_probe._AGREE[(id(mirrored2), 8)]
        assert agree.experimental_get_tracing_count() == 1
        assert link_probe.agree_mean(mirrored2, [2.0] * 9) == [2.0] * 9  # padded to 16
        assert len(link_probe._AGREE) == traced + 1


def test_probes_grow_until_the_time_or_the_cap(mirrored2):
    with mirrored2.scope():
        out = link_probe.grown_probes(mirrored2, [64, 256], 1, 10.0,
                                      {"sum": 9000, "gather": 5000})
        # one function for all rounds, both kinds
        assert link_probe._PROBES[id(mirrored2)].function.experimental_get_tracing_count() == 1
        sizes, times = out["sum"]
        assert sizes == [64, 256, 1024, 4096, 9000] and len(times) == 5  # capped at 9000
        assert out["gather"][0] == [64, 256, 1024, 4096]  # 5000 would add < 2x: no trace
        out = link_probe.grown_probes(mirrored2, [64, 256], 1, 0.0, {"gather": 5000})
        assert list(out) == ["gather"] and out["gather"][0] == [64, 256]  # took >= 0 s
        out = link_probe.grown_probes(mirrored2, [64, 256, 4096], 1, 0.0, {"sum": 100})
        assert out["sum"][0] == [64, 100]  # capped: nothing larger than needed


@pytest.mark.parametrize("probes,calls,match", [
    ([("max", 64)], 1, "probes"), ([("sum", 0)], 1, "probes"), ([], 1, "probes"),
    ([("sum", 64)], 0, "calls")])
def test_collective_probes_reject_bad_input(mirrored2, probes, calls, match):
    with mirrored2.scope(), pytest.raises(ValueError, match=match):
        link_probe.time_collectives(mirrored2, probes, calls)


def test_compression_probe_rejects_bad_repeats():
    with pytest.raises(ValueError, match="repeats"):
        link_probe.time_compression([_comp((8, 4))], [["float32"]], repeats=0)


def test_a_re_measurement_reuses_the_traced_probes(mirrored2):
    comps, dtypes, cache = [_comp((64, 32))], [["float32"]], {}
    with mirrored2.scope():
        link_probe.time_compression(comps, dtypes, repeats=1, cache=cache)
        (probe,) = cache.values()
        link_probe.time_compression(comps, dtypes, repeats=1, cache=cache)
        assert list(cache.values()) == [probe]


@pytest.mark.parametrize("policy,timed", [
    (AutoExchange(convergence_cost=100.0), False),  # sparse cannot win: nothing to time
    (AutoExchange(candidates=("allgather", "shared")), True)])
def test_compression_is_timed_only_where_a_sparse_mode_could_win(mirrored2, policy, timed):
    comps = [_comp((64, 32)), _comp((32, 16))]
    chooser = ExchangeChooser(policy, mirrored2, [[0], [1]], comps, [["float32"]] * 2)
    decision = chooser.decide(compute_s=0.01)
    assert bool(chooser._probe_cache) == timed
    assert (decision.compress_s > 0) == timed
    assert all(g.compress_s == 0 for g in decision.groups) != timed


def test_collective_probes_run_under_op_determinism():
    """``--deterministic`` runs enable op determinism, which refuses ``tf.timestamp``: the
    probes still time (a fresh process, so the rest of the suite keeps its settings)."""
    code = (
        "import tensorflow as tf\n"
        "tf.config.experimental.enable_op_determinism()\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "logical = [tf.config.LogicalDeviceConfiguration()] * 2\n"
        "tf.config.set_logical_device_configuration(cpu, logical)\n"
        "from tf_blocksparse.auto import link_probe\n"
        "s = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])\n"
        "with s.scope():\n"
        "    t = link_probe.time_collectives(s, [('sum', 1024), ('gather', 4096)], 2)\n"
        "assert len(t) == 2 and all(x > 0 for x in t), t\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

