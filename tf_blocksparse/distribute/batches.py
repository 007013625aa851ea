"""Which cross-device reductions are gradient batches (shared by the custom ops)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def is_gradient_batch(reduce_op: Any, values: Sequence[Any], min_devices: int = 1) -> bool:
    """True for a SUM batch of per-replica, dense, floating, fully-shaped tensors.

    That is what an optimizer's gradient all-reduce hands to ``batch_reduce``; metrics,
    ``strategy.reduce`` calls, MEAN reductions, integers and ``IndexedSlices`` are not.

    Args:
      reduce_op: The reduction.
      values: The batch's distributed values.
      min_devices: Fewest per-replica components a value must have.
    """
    if reduce_op != tf.distribute.ReduceOp.SUM or not values:
        return False
    for v in values:
        locals_ = getattr(v, "values", None)
        if not isinstance(v, tf.distribute.DistributedValues) or locals_ is None \
                or len(locals_) < min_devices or isinstance(locals_[0], tf.IndexedSlices):
            return False
        t = locals_[0]
        if not t.dtype.is_floating or not t.shape.is_fully_defined():
            return False
    return True
