"""The one wall-clock timer of the package's own measurements (TF-free).

Used where the library times something itself: the automatic exchange's link and
compression probes (:mod:`tf_blocksparse.distribute.link_probe`) and the layer profiler
(:mod:`tf_blocksparse.keras.profiler`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["median_seconds"]


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
