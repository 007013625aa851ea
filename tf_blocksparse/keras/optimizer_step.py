"""Pieces of ``BlockSparseOptimizer``'s step that need no optimizer state of their own:
the fusion plan, the finite-step guard, the statistics row and the inner optimizer's apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import codec
from tf_blocksparse.exchange import ExchangeResult
from tf_blocksparse.planning.balanced import plan_backward
from tf_blocksparse.planning.fusion import FusionPlan


def fusion_plan(tensors: Sequence[Any], idx: Sequence[int], ranks: Sequence[int] | None,
                buffer_bytes: int) -> FusionPlan:
    """Balanced plan of ``tensors`` (tensors or specs of the variables ``idx``) in the
    backward order ``ranks`` (per variable index) when known, else the reverse of their
    order."""
    order = None
    if ranks is not None:
        order = sorted(range(len(tensors)), key=lambda p: ranks[idx[p]])
    return plan_backward([codec.buffer_nbytes(t) for t in tensors],
                         [tf.as_dtype(t.dtype).name for t in tensors], buffer_bytes,
                         order=order)


def when_finite(nonfinite: str, finite: tf.Tensor, fn: Any) -> None:
    """Runs ``fn`` (state commits) only when the step is finite, unless ``"apply"``."""
    if nonfinite == "apply":
        fn()
    else:
        tf.cond(finite, fn, tf.no_op)


def record_stats(stats: keras.Variable, result: ExchangeResult) -> None:
    """Writes the step's figures (``STAT_NAMES`` order) into the per-replica ``stats``."""
    old = tf.convert_to_tensor(stats.value)
    skipped = old[4] + tf.cast(tf.logical_not(result.finite), tf.float32)
    stats.value.assign(tf.stack([
        tf.constant(float(result.payload_bytes)), tf.constant(float(result.dense_bytes)),
        tf.constant(float(result.blocks_kept)), tf.cast(result.residual_norm, tf.float32),
        skipped]))


def apply_inner(inner: keras.optimizers.Optimizer, nonfinite: str,
                updates: Sequence[tf.Tensor], tvs: Sequence[Any], finite: tf.Tensor) -> None:
    """``inner.apply(updates, tvs)`` on every replica, skipped everywhere when not finite.

    Where the strategy still needs a merge call (MirroredStrategy), the condition is taken
    in cross-replica context, so every replica takes the same branch.
    """
    if nonfinite == "apply":
        inner.apply(list(updates), tvs)
        return
    if not tf.distribute.has_strategy() or \
            tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(finite, lambda: inner.apply(list(updates), tvs), lambda: None)
        return

    def cross_replica(distribution: Any, updates: Any, finite: Any) -> None:
        flag = distribution.experimental_local_results(finite)[0]

        def apply_fn() -> None:
            distribution.extended.call_for_each_replica(inner.apply, args=(updates, tvs))

        tf.cond(flag, apply_fn, lambda: None)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(list(updates), finite))
