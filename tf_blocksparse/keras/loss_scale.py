"""Loss scaling around ``BlockSparseOptimizer``: one skip decision for every replica.

A loss-scale optimizer checks the gradients for an inf or NaN *before* its inner optimizer
sees them, and either applies the step or skips it and halves its scale.  Keras'
``keras.optimizers.LossScaleOptimizer`` checks the local gradients, since its own optimizers
all-reduce them afterwards.  The wrapper exchanges each replica's own gradients, so that local
check could differ between replicas: under ``MultiWorkerMirroredStrategy`` the worker that
overflowed would skip the step while the others waited in the exchange for it, for ever;
under ``MirroredStrategy`` Keras takes replica 0's check for all, so an overflow on another
replica would keep the scale (and the wrapper would skip every step after it).

:class:`LossScaleOptimizer` is Keras' loss-scale optimizer with the check every replica
agrees on (:func:`finite_on_every_replica`: the local check summed over replicas with one
scalar all-reduce), so a step that overflows anywhere is skipped everywhere, and every replica
lowers its scale.  With several replicas, wrap the optimizer in it yourself::

    model.compile(optimizer=tfbs.LossScaleOptimizer(tfbs.BlockSparseOptimizer(...)), ...)

``model.compile`` then keeps it (it wraps an optimizer under ``mixed_float16`` only when it is
not a loss-scale optimizer already).  Keras' own class around the wrapper is refused with
several replicas at the first step, naming this one (:func:`check_outer_loss_scale`); with one
replica the local check is every replica's, and either class works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.keras.fit_loop import BlockSparseBase

__all__ = ["LossScaleOptimizer", "check_outer_loss_scale", "finite_on_every_replica",
           "locally_finite"]


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


@keras.saving.register_keras_serializable(package="tf_blocksparse")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """``keras.optimizers.LossScaleOptimizer`` whose overflow check every replica agrees on.

    The same arguments, state, config and saved variables as Keras' class; only the check
    differs: the inner optimizer's ``agreed_finite(grads)`` where it has one
    (``BlockSparseOptimizer``, which also counts the step in ``skipped_steps``), else
    :func:`finite_on_every_replica`.  Costs one all-reduce of a float32 scalar per step.

    Args:
      inner_optimizer: The optimizer whose loss it scales (e.g. a ``BlockSparseOptimizer``).
      initial_scale: The initial loss scale.
      dynamic_growth_steps: Finite steps after which the scale doubles.
      name: Optimizer name.
      **kwargs: Keras' ``LossScaleOptimizer`` keywords.
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer,
                 initial_scale: float = 2.0 ** 15, dynamic_growth_steps: int = 2000,
                 name: str | None = None, **kwargs: Any):
        if isinstance(inner_optimizer, BlockSparseBase):
            # before Keras' constructor clears the inner's loss scale factor, which is how
            # the wrapper learns that a loss-scale optimizer wraps it
            inner_optimizer.loss_scaled_by = "agreed"
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)

    def check_finite(self, grads: Sequence[Any]) -> tf.Tensor:
        """Scalar bool, the same on every replica: no replica's ``grads`` hold an inf or
        NaN."""
        agreed = getattr(self.inner_optimizer, "agreed_finite", None)
        return agreed(grads) if callable(agreed) else finite_on_every_replica(grads)


def check_outer_loss_scale(loss_scaled_by: str | None, replicas: int) -> None:
    """Refuses Keras' own loss-scale optimizer around the wrapper with several replicas.

    Args:
      loss_scaled_by: The wrapper's ``loss_scaled_by``: ``"keras"`` when a loss-scale
        optimizer other than :class:`LossScaleOptimizer` wraps it.
      replicas: Replicas in sync.

    Raises:
      ValueError: Keras' class wraps it and there are several replicas.
    """
    if loss_scaled_by == "keras" and replicas > 1:
        raise ValueError(
            f"`optimizer`: keras.optimizers.LossScaleOptimizer wraps the "
            f"BlockSparseOptimizer with {replicas} replicas; its overflow check sees only "
            "the local gradients, so replicas could disagree on skipping a step (a hang "
            "across workers). Use tfbs.LossScaleOptimizer(BlockSparseOptimizer(...)) "
            "instead (model.compile keeps it under mixed_float16): every replica skips an "
            "overflowing step together")
