"""Loss scaling around ``BlockSparseOptimizer``: one skip decision for every replica.

``keras.optimizers.LossScaleOptimizer`` (which ``model.compile`` puts around the optimizer
under the ``mixed_float16`` policy) checks the gradients for an inf or NaN *before* its
inner optimizer sees them, and either applies the step or skips it and halves its scale.
Keras checks the local gradients, since its own optimizers all-reduce them afterwards.  The
wrapper exchanges each replica's own gradients, so that local check could differ between
replicas: under ``MultiWorkerMirroredStrategy`` the worker that overflowed skipped the step
while the others waited in the exchange for it, for ever; under ``MirroredStrategy`` Keras
took replica 0's check for all, so an overflow on another replica kept the scale.

:func:`finite_on_every_replica` is the check the wrapper gives ``LossScaleOptimizer``
instead (through :func:`tf_blocksparse._compat.delegate_loss_scale_check`): the local check
summed over replicas with one scalar all-reduce, so a step that overflows anywhere is
skipped everywhere, and every replica lowers its scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["finite_on_every_replica", "locally_finite"]


def locally_finite(grads: Sequence[Any]) -> tf.Tensor:
    """Scalar bool: every entry of this replica's ``grads`` is finite (``None`` skipped,
    ``IndexedSlices`` by their values)."""
    flags = []
    for g in grads:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)
        flags.append(tf.reduce_all(tf.math.is_finite(values)))
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))


def finite_on_every_replica(grads: Sequence[Any]) -> tf.Tensor:
    """Scalar bool, identical on every replica: no replica's ``grads`` hold an inf or NaN.

    Call it in replica context (as ``LossScaleOptimizer`` calls its check); outside a
    strategy, with one replica, or in cross-replica context it is the local check.  With
    several replicas it costs one all-reduce of a float32 scalar (the count of replicas
    whose gradients are not finite).
    """
    local = locally_finite(grads)
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return local
    ctx = tf.distribute.get_replica_context()
    if ctx.num_replicas_in_sync == 1:
        return local
    overflowed = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.cast(tf.logical_not(local), tf.float32))
    return tf.equal(overflowed, 0.0)
