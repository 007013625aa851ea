"""A ``MultiWorkerMirroredStrategy`` that Keras 3 ``model.fit`` can use.

Keras 3's TensorFlow trainer calls ``strategy.reduce("MEAN", batch, axis=None)`` on the
nested data batch and ``strategy.reduce("MEAN", scalar_metric, axis=0)`` on scalar metric
values (keras-team/keras#20585); TF's multi-worker strategy rejects both.  This subclass
reduces leaf by leaf and drops ``axis`` for scalars.

TF's collectives take only a few dtypes (reduce: bfloat16, float16/32/64, int32/64; gather:
no bfloat16), while Keras sends whatever the data holds, e.g. the uint8 labels of
``keras.datasets.fashion_mnist``.  ``reduce`` and ``gather`` send any other integer or bool
value as int32 (int64 for 32- and 64-bit unsigned ones) and bfloat16 as float32, and cast the
result back to the value's dtype; only a MEAN of integers or bools stays what TF's MEAN of
int32 gives, the exact float64 mean.  Only the bytes on the wire grow.

On a slow link the first collectives (the broadcast of the initial weights: 69 MB for
``vgg_fc``, about a minute at 10 Mbit/s) can hold up the coordination service's heartbeats
longer than TensorFlow's default timeout (10 s), and the job dies with "tasks stopped sending
heartbeats".  ``heartbeat_timeout_s`` sets a longer one (every worker must pass the same);
a dead worker is then noticed that much later.  Everything else is TF's strategy.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.planning.link_cost import number

#: The dtypes TF's collective all-reduce (``CollectiveReduceV2``) takes.
REDUCE_DTYPES = frozenset({tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32,
                           tf.int64})
#: The dtypes TF's collective all-gather (``CollectiveGatherV2``) takes.
GATHER_DTYPES = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})


def wire_dtype(dtype: Any, supported: Collection[tf.DType]) -> tf.DType | None:
    """The dtype a value of ``dtype`` travels as through a collective taking ``supported``.

    Returns:
      ``None`` when ``dtype`` is supported (or has no exact stand-in: TF's own error then
      names it); int32 for bool and integers of up to 16 bits, int64 for uint32 and uint64
      (a uint64 above 2**63 wraps, which a SUM undoes when cast back), float32 for bfloat16.
    """
    dtype = tf.as_dtype(dtype)
    if dtype in supported:
        return None
    if dtype == tf.bool or (dtype.is_integer and not dtype.is_quantized and dtype.size <= 2):
        wide = tf.int32
    elif dtype in (tf.uint32, tf.uint64):
        wide = tf.int64
    elif dtype == tf.bfloat16:
        wide = tf.float32
    else:
        return None
    return wide if wide in supported else None


def _narrow(result: tf.Tensor, dtype: tf.DType | None) -> tf.Tensor:
    """``result`` of a collective over values widened from ``dtype`` (``None``: not widened)
    cast back to ``dtype``; a float result of widened integers (TF's MEAN) stays as it is."""
    if dtype is None or (result.dtype.is_floating and not dtype.is_floating):
        return result
    return tf.cast(result, dtype)


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """``tf.distribute.MultiWorkerMirroredStrategy`` with a structure-aware ``reduce`` and
    a ``reduce`` / ``gather`` for every integer and bool dtype (module docstring).

    Use exactly like TF's class (it reads ``TF_CONFIG`` or takes a cluster resolver).

    Args:
      cluster_resolver: As TF's (default: ``TF_CONFIG``'s cluster).
      communication_options: As TF's.
      heartbeat_timeout_s: Seconds without a heartbeat after which the coordination
        service declares a worker dead (``None``: TensorFlow's default, 10 s).  Raise it
        on slow links (module docstring); every worker must pass the same value.

    Raises:
      ValueError: ``heartbeat_timeout_s`` is not a positive number, or the coordination
        service of this process was configured already with another timeout.
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: Any = None, *,
                 heartbeat_timeout_s: float | None = None):
        if heartbeat_timeout_s is not None:
            heartbeat_timeout_s = number("heartbeat_timeout_s", heartbeat_timeout_s,
                                         positive=True)
            if cluster_resolver is None:
                cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            spec = cluster_resolver.cluster_spec()
            if spec.jobs and cluster_resolver.task_type in ("chief", "worker"):
                if (not _compat.configure_coordination(spec, heartbeat_timeout_s) and
                        (have := _compat.coordination_heartbeat_timeout_s())
                        != heartbeat_timeout_s):
                    raise ValueError(
                        f"`heartbeat_timeout_s`={heartbeat_timeout_s}: this process's "
                        f"coordination service is configured already (heartbeat timeout "
                        f"{have or 'default'}); create the strategy before any other")
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Reduces every leaf of ``value``; scalars are reduced across replicas only.

        A leaf of a dtype the collective does not take is reduced as :func:`wire_dtype`
        and cast back, except a MEAN of integers or bools: float64, as TF's MEAN of int32.
        """

        def leaf(v: Any) -> Any:
            ax = axis
            if ax is not None:
                rank = getattr(v, "shape", None)
                if rank is None and isinstance(v, tf.distribute.DistributedValues):
                    rank = self.experimental_local_results(v)[0].shape
                if rank is not None and rank.rank == 0:
                    ax = None
            v, dtype = self._widen(v, REDUCE_DTYPES)
            out = super(MultiWorkerMirroredStrategy, self).reduce(reduce_op, v, axis=ax)
            return _narrow(out, dtype)

        return tf.nest.map_structure(leaf, value)

    def gather(self, value: Any, axis: int) -> Any:
        """TF's ``gather``, for every integer and bool dtype too (as :func:`wire_dtype`)."""

        def leaf(v: Any) -> Any:
            v, dtype = self._widen(v, GATHER_DTYPES)
            return _narrow(super(MultiWorkerMirroredStrategy, self).gather(v, axis), dtype)

        return tf.nest.map_structure(leaf, value)

    def _widen(self, value: Any, supported: Collection[tf.DType]) -> tuple[Any, tf.DType | None]:
        """``value`` cast to its wire dtype, and its own dtype (``None``: sent as it is)."""
        distributed = isinstance(value, tf.distribute.DistributedValues)
        local = self.experimental_local_results(value)[0] if distributed else value
        dtype = getattr(local, "dtype", None) or tf.convert_to_tensor(local).dtype
        wide = wire_dtype(dtype, supported)
        if wide is None:
            return value, None
        if distributed:
            return self.run(tf.cast, args=(value, wide)), tf.as_dtype(dtype)
        return tf.cast(value, wide), tf.as_dtype(dtype)


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


def cross_device_ops(strategy: tf.distribute.Strategy) -> tf.distribute.CrossDeviceOps:
    """The ``CrossDeviceOps`` a ``MirroredStrategy`` (or a multi-worker one) reduces with:
    the one it was given, or the one TensorFlow picked for its devices, e.g. to record
    which reduction a benchmark measured."""
    return _compat.strategy_cross_device_ops(strategy)
