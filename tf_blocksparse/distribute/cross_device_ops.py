"""``BlockSparseCrossDeviceOps``: the block-sparse exchange for ``MirroredStrategy``.

``tf.distribute.MirroredStrategy(cross_device_ops=tfbs.BlockSparseCrossDeviceOps(k=1))``
with a *plain* Keras optimizer: the optimizer's gradient all-reduce (a SUM ``batch_reduce`` of
per-replica float tensors) becomes, per device, error feedback + block top-k selection (the
same :class:`~tf_blocksparse.feedback.BlockTopK` core as ``BlockSparseOptimizer``) and the
sum of every device's selected blocks.  Residuals are owned by this object: one variable per
device and gradient, created on first use.  Everything else -- single ``reduce`` calls
(metrics, ``strategy.reduce``), MEAN reductions, integer values, ``all_gather`` -- is a dense
pass-through (reduce to one device, then broadcast).

Variables are identified by position and shape in the gradient batch; give ``model=`` so
the block-rule table sees their layer classes (otherwise rank-2+ tensors split along the
last axis, vectors per element).

Checkpoints: the residuals hang off :attr:`BlockSparseCrossDeviceOps.state`, a
``tf.Module``; put it in a ``tf.train.Checkpoint`` beside the model and optimizer
(``tf.train.Checkpoint(model=m, optimizer=o, residuals=ops.state)``).  Restoring before the
first step works: the residuals are created on first use and take the restored values then.

Non-finite gradients: when any device's gradient batch holds a NaN or Inf, the residuals are
left unchanged and the *dense* sum goes to the optimizer (so its values are non-finite, as with
the default reduction, and a ``LossScaleOptimizer`` skips the step).  A plain optimizer cannot
be told to skip from here; use ``BlockSparseOptimizer(nonfinite="skip")`` for that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import blocks, codec, selection
from tf_blocksparse.distribute.batches import is_gradient_batch
from tf_blocksparse.feedback import (
    DEFAULT_DENSE_BELOW,
    BlockTopK,
    ElementTopK,
    validate_dense_below,
    validate_k_density,
)

_SPARSE_EXCHANGES = ("allgather", "shared")


class _ResidualState(tf.Module):
    """Trackable holder of the per-device residuals (``batches[i][device][gradient]``)."""

    def __init__(self) -> None:
        super().__init__(name="block_sparse_residuals")
        self.batches: list[list[list[tf.Variable]]] = []


class BlockSparseCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Block-sparse SUM of gradient batches across the devices of one process.

    Args:
      k: Blocks kept per variable per device (default 1).
      density: Alternatively, the fraction of blocks kept.
      metric: ``"l1"`` or ``"l2"``.
      exchange: ``"allgather"`` (each device its own blocks) or ``"shared"`` (blocks chosen
        from the scores summed over devices).
      model: Optional Keras model whose ``trainable_variables`` the gradients belong to.
      block_rules: Optional ``{path regex: rule name}`` overrides.
      granularity: ``"block"`` or ``"element"`` (element-wise top-k baseline).
      dense_below: Gradients with fewer elements than this are sent whole (see
        ``BlockSparseOptimizer``); default 1024, 0 compresses all.
    """

    def __init__(self, k: int | None = None, density: float | None = None,
                 metric: str = "l1", exchange: str = "allgather", model: Any = None,
                 block_rules: Mapping[str, str] | None = None, granularity: str = "block",
                 dense_below: int = DEFAULT_DENSE_BELOW):
        self.k, self.density = validate_k_density(k, density)
        self.dense_below = validate_dense_below(dense_below)
        if metric not in selection.METRICS:
            raise ValueError(f"`metric` must be one of {selection.METRICS}, got {metric!r}")
        if exchange not in _SPARSE_EXCHANGES:
            raise ValueError(f"`exchange` must be one of {_SPARSE_EXCHANGES}, got {exchange!r}")
        if granularity not in ("block", "element"):
            raise ValueError(f"`granularity` must be 'block' or 'element', got {granularity!r}")
        for rule in (block_rules or {}).values():
            blocks._as_rule(rule, "block_rules")
        super().__init__()
        self.metric, self.exchange, self.granularity = metric, exchange, granularity
        self.block_rules = dict(block_rules or {})
        self._model = model
        self._residuals: dict[tuple, list[list[tf.Variable]]] = {}
        self.state = _ResidualState()
        self.payload_bytes = 0  # per device per step, set when a gradient batch is traced
        self.dense_bytes = 0

    def bind_model(self, model: Any) -> None:
        """Names the Keras model whose gradients this reduces (the strategy, and so these
        ops, exist before the model; call this once the model is built, before training)."""
        if not hasattr(model, "trainable_variables"):
            raise TypeError(f"`model` must be a Keras model, got {model!r}")
        self._model = model

    # -- which reductions are gradient batches ---------------------------------------------
    def _layouts(self, shapes: Sequence[tuple[int, ...]]) -> list[blocks.BlockLayout]:
        variables = list(getattr(self._model, "trainable_variables", []) or [])
        if [tuple(v.shape) for v in variables] == list(shapes):
            return blocks.layouts_for(variables, self._model, self.block_rules)
        return [blocks.rule_for(f"gradient_{i}/{'kernel' if len(s) >= 2 else 'bias'}", s,
                                overrides=self.block_rules) for i, s in enumerate(shapes)]

    def _state(self, key: tuple, devices: Sequence[str], layouts: Sequence[blocks.BlockLayout],
               dtypes: Sequence[tf.DType]) -> list[list[tf.Variable]]:
        if key not in self._residuals:
            per_device = []
            with tf.init_scope():  # created once, eagerly, even when first seen in a trace
                for d, dev in enumerate(devices):
                    with tf.device(dev):
                        per_device.append([
                            tf.Variable(tf.zeros(lay.shape, dt), trainable=False,
                                        name=f"residual_{i}_replica_{d}")
                            for i, (lay, dt) in enumerate(zip(layouts, dtypes))])
            with tf.init_scope():  # tracking restores values from a pending checkpoint
                self.state.batches.append(per_device)
                self._residuals[key] = self.state.batches[-1]
        return self._residuals[key]

    @property
    def residuals(self) -> dict[tuple, list[list[tf.Variable]]]:
        """``{batch signature: [per device [per gradient residual variable]]}``."""
        return self._residuals

    # -- the exchange ----------------------------------------------------------------------
    def batch_reduce_implementation(self, reduce_op: Any, value_destination_pairs: Any,
                                    options: Any) -> list[Any]:
        values = [v for v, _ in value_destination_pairs]
        if not is_gradient_batch(reduce_op, values, min_devices=2):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                       options)
        devices = [t.device for t in values[0].values]
        shapes = [tuple(v.values[0].shape) for v in values]
        dtypes = [v.values[0].dtype for v in values]
        layouts = self._layouts(shapes)
        comp_cls = ElementTopK if self.granularity == "element" else BlockTopK
        comp = comp_cls(layouts, self.k, self.density, self.metric, self.dense_below)
        state = self._state((tuple(devices), tuple(shapes)), devices, layouts, dtypes)
        prepared, flags = [], []
        for d, dev in enumerate(devices):
            with tf.device(dev):
                grads = [v.values[d] for v in values]
                flags.append(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))
                prepared.append(comp.prepare(grads, [r.read_value() for r in state[d]]))
        with tf.device(devices[0]):
            finite = tf.reduce_all(tf.stack(flags))
        with tf.device(devices[0]):
            if self.exchange == "shared":
                summed = [tf.add_n([p.scores[i] for p in prepared]) for i in range(len(values))]
                common = comp.select(summed)
                ids = [common] * len(devices)
            else:
                ids = [None] * len(devices)
        payloads = []
        for d, dev in enumerate(devices):
            with tf.device(dev):
                chosen = ids[d] if ids[d] is not None else comp.select(prepared[d].scores)
                payload, new_state = comp.finish(prepared[d], chosen)
                for r, s in zip(state[d], new_state):
                    r.assign(tf.where(finite, s, r.read_value()))
                payloads.append(payload)
        ids_sent = [i for i, whole in zip(payloads[0].ids, comp.whole) if not whole]
        self.payload_bytes = sum(codec.buffer_nbytes(t)  # no ids for variables sent whole
                                 for t in (*ids_sent, *payloads[0].values))
        self.dense_bytes = sum(codec.buffer_nbytes(v.values[0]) for v in values)
        results = []
        with tf.device(devices[0]):
            for i, (lay, (_, dest)) in enumerate(zip(comp.layouts, value_destination_pairs)):
                rows = tf.concat([p.values[i] for p in payloads], axis=0)
                row_ids = tf.concat([p.ids[i] for p in payloads], axis=0)
                update = selection.scatter_blocks(rows, row_ids, lay)
                dense = values[i].values
                update = tf.cond(finite, lambda u=update: u,
                                 lambda d=dense: tf.add_n([tf.identity(t) for t in d]))
                results.append(self.broadcast_implementation(update, dest))
        return results
