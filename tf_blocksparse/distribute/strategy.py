"""A ``MultiWorkerMirroredStrategy`` that Keras 3 ``model.fit`` can use.

Keras 3's TensorFlow trainer calls ``strategy.reduce("MEAN", batch, axis=None)`` on the
nested data batch and ``strategy.reduce("MEAN", scalar_metric, axis=0)`` on scalar metric
values (keras-team/keras#20585); TF's multi-worker strategy rejects both.  This subclass
reduces leaf by leaf and drops ``axis`` for scalars.  Everything else is TF's strategy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


class WorkerRole(NamedTuple):
    """This process's place in the cluster: worker count, global index (the chief, if the
    cluster names one, is 0), and whether it is the chief (writes checkpoints and logs)."""

    num_workers: int
    index: int
    is_chief: bool


def worker_role(strategy: tf.distribute.Strategy) -> WorkerRole:
    """The :class:`WorkerRole` of this process under ``strategy`` (1, 0, True without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not spec:
        return WorkerRole(1, 0, True)
    has_chief = "chief" in spec
    workers = len(spec.get("worker", [])) + len(spec.get("chief", []))
    index = int(resolver.task_id or 0) + (1 if has_chief and resolver.task_type == "worker"
                                          else 0)
    return WorkerRole(workers, index, index == 0)
