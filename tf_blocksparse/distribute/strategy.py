"""A ``MultiWorkerMirroredStrategy`` that Keras 3 ``model.fit`` can use.

Keras 3's TensorFlow trainer calls ``strategy.reduce("MEAN", batch, axis=None)`` on the
nested data batch and ``strategy.reduce("MEAN", scalar_metric, axis=0)`` on scalar metric
values (keras-team/keras#20585); TF's multi-worker strategy rejects both.  This subclass
reduces leaf by leaf and drops ``axis`` for scalars.  Everything else is TF's strategy.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """``tf.distribute.MultiWorkerMirroredStrategy`` with a structure-aware ``reduce``.

    Use exactly like TF's class (it reads ``TF_CONFIG`` or takes a cluster resolver).
    """

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Reduces every leaf of ``value``; scalars are reduced across replicas only."""

        def leaf(v: Any) -> Any:
            ax = axis
            if ax is not None:
                rank = getattr(v, "shape", None)
                if rank is None and isinstance(v, tf.distribute.DistributedValues):
                    rank = self.experimental_local_results(v)[0].shape
                if rank is not None and rank.rank == 0:
                    ax = None
            return super(MultiWorkerMirroredStrategy, self).reduce(reduce_op, v, axis=ax)

        return tf.nest.map_structure(leaf, value)
