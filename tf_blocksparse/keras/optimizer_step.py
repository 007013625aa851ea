"""Pieces of ``BlockSparseOptimizer``'s step that need no optimizer state of their own:
momentum masking, the finite-step guard, the statistics row and the inner optimizer's apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import selection
from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.exchange import ExchangeResult

MASKINGS = ("all", "waited", "none")


def mask_sent(us: Sequence[tf.Tensor], layouts: Sequence[BlockLayout],
              sent_ids: Sequence[tf.Tensor] | None,
              residuals: Sequence[tf.Tensor] | None = None) -> list[tf.Tensor]:
    """DGC factor masking of the local momenta.

    Args:
      us: Per variable the replica's momentum ``u`` [*shape].
      layouts: Their block layouts.
      sent_ids: Per variable the block ids [k_v] this replica sent (``None``: dense, all
        sent; the momenta then carry on whole, which is momentum SGD).
      residuals: Optional per-variable residuals [*shape] from *before* this step: only
        sent blocks whose residual block was non-zero (they had waited) are zeroed.

    Returns:
      Per variable ``u`` with the masked blocks zeroed (the others bit-exact).
    """
    if sent_ids is None:
        return list(us)
    if residuals is None:
        return [selection.zero_blocks(u, lay, ids, selection.block_flat_indices(ids, lay))
                for u, lay, ids in zip(us, layouts, sent_ids)]
    return [selection.zero_blocks_where(
                u, lay, selection.blocks_hit(ids, lay) &
                (selection.block_scores(r, lay, "l1") > 0))
            for u, lay, ids, r in zip(us, layouts, sent_ids, residuals)]


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
