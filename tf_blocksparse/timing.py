"""The wall-clock timers of the package's own measurements.

Used where the library times something itself: the automatic exchange's link and
compression probes (:mod:`tf_blocksparse.auto.link_probe`), the optimizer wrapper's
time per step and the layer profiler (:mod:`tf_blocksparse.pipeline.profiler`).
:func:`median_seconds` times calls from Python; :func:`graph_clock` reads the clock inside
a TensorFlow graph; :func:`load_trace` reads what TensorFlow's profiler recorded, to
measure a step op by op (TensorFlow is imported inside those two only, so the module stays
TF-free).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tf_blocksparse import _compat

__all__ = ["graph_clock", "load_trace", "median_seconds"]


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                   sync: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    Args:
      fn: The work; it must finish before it returns (fetch its result, or pass ``sync``).
      repeats: Timed calls.
      warmup: Untimed calls first (tracing, first runs).
      sync: Called once after the warm-up and after every timed call, inside the timing
        (e.g. ``tf.test.experimental.sync_devices`` for asynchronous devices).

    Raises:
      ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need `repeats` >= 1 and `warmup` >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_clock(after: Sequence[Any] = ()) -> Any:
    """Seconds of a monotonic clock (a float64 scalar tensor), read inside a graph once
    every tensor of ``after`` is computed.

    The tensors are inputs (one element of each), not control dependencies: Grappler turns
    a stateless op whose results only feed control edges into a no-op, so the work would
    not run before the clock is read.  A Python call in the graph rather than
    ``tf.timestamp``, which ``tf.config.experimental.enable_op_determinism()`` forbids.
    Its value never reaches any training math.
    """
    import tensorflow as tf

    firsts = [tf.cast(tf.reshape(t, [-1])[:1], tf.float32) for t in after]
    inputs = [tf.concat(firsts, 0)] if firsts else []  # one small input: cheap to hand over
    return tf.py_function(lambda *_: np.float64(time.perf_counter()), inputs, tf.float64)


def load_trace(path: str) -> Any:
    """A trace file of TensorFlow's profiler (an ``*.xplane.pb`` that
    ``tf.profiler.experimental`` writes under ``LOGDIR/plugins/profile/RUN/``) as its
    ``XSpace`` protocol buffer message: planes (``/host:CPU``, devices), each with lines of
    timed events and their metadata.

    Args:
      path: The ``*.xplane.pb`` file.

    Raises:
      OSError: The file cannot be read.
      google.protobuf.message.DecodeError: It is not an ``XSpace``.
    """
    space = _compat.xplane_proto().XSpace()
    with open(path, "rb") as fh:
        space.ParseFromString(fh.read())
    return space
