"""The package's timers: the Python one against a fake clock, the in-graph one for real."""

import time

import pytest
import tensorflow as tf

from tf_blocksparse import timing


def test_median_seconds_warms_up_syncs_and_takes_the_median(monkeypatch):
    now = [0.0]
    durations = iter([100.0, 50.0, 3.0, 1.0, 2.0])  # two warm-up calls, then three timed
    events = []

    def fn():
        events.append("call")
        now[0] += next(durations)

    def sync():
        events.append("sync")
        now[0] += 0.5  # inside the timing

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    assert timing.median_seconds(fn, repeats=3, warmup=2, sync=sync) == 2.5
    assert events == ["call", "call", "sync"] + ["call", "sync"] * 3
    assert timing.median_seconds(lambda: None, repeats=1, warmup=0) == 0.0
    with pytest.raises(ValueError, match="repeats"):
        timing.median_seconds(fn, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        timing.median_seconds(fn, repeats=1, warmup=-1)


def test_the_in_graph_clock_waits_for_stateless_work():
    """Grappler drops a stateless op whose result only feeds control edges: the clock must
    take the work's result as an input, or it would read before (without) the work."""

    def slow(x):
        time.sleep(0.05)
        return x

    @tf.function
    def elapsed(x):
        start = timing.graph_clock([x])
        with tf.control_dependencies([start]):
            x = tf.identity(x)
        y = tf.numpy_function(slow, [x], tf.float32, stateful=False)
        return timing.graph_clock([y]) - start

    assert elapsed(tf.ones(3)).numpy() >= 0.05


def test_load_trace_reads_a_profiler_xspace(tmp_path):
    from tf_blocksparse import _compat

    space = _compat.xplane_proto().XSpace()
    space.planes.add().name = "/host:CPU"
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(space.SerializeToString())
    assert [p.name for p in timing.load_trace(str(path)).planes] == ["/host:CPU"]
