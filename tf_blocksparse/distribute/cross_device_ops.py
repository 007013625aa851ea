"""``BlockSparseCrossDeviceOps``: the block-sparse exchange for ``MirroredStrategy``.

``tf.distribute.MirroredStrategy(cross_device_ops=tfbs.BlockSparseCrossDeviceOps(k=1))``
with a *plain* Keras optimizer: the optimizer's gradient all-reduce (a SUM ``batch_reduce`` of
per-replica float tensors) becomes, per device, error feedback + block top-k selection and the
sum of every device's selected blocks: the same exchange as ``BlockSparseOptimizer``
(:func:`tf_blocksparse.distribute.device_exchange.run_on_devices`), configured by the same
:class:`~tf_blocksparse.options.CompressionOptions`.  Residuals are owned by this object: one
variable per device and gradient, created on first use.  Everything else -- single ``reduce`` calls
(metrics, ``strategy.reduce``), MEAN reductions, integer values, ``all_gather`` -- is a dense
pass-through (reduce to one device, then broadcast).

Variables are identified by position and shape in the gradient batch; give ``model=`` so
the block-rule table sees their layer classes (otherwise rank-2+ tensors split along the
last axis, vectors per element).

Checkpoints: the residuals hang off :attr:`BlockSparseCrossDeviceOps.state`, a
``tf.Module``; put it in a ``tf.train.Checkpoint`` beside the model and optimizer
(``tf.train.Checkpoint(model=m, optimizer=o, residuals=ops.state)``).  Restoring before the
first step works: the residuals are created on first use and take the restored values then.

Non-finite gradients: when any device's accumulated gradient (gradient + residual) holds a
NaN or Inf, the residuals are
left unchanged and the *dense* sum goes to the optimizer (so its values are non-finite, as with
the default reduction, and a ``LossScaleOptimizer`` skips the step).  A plain optimizer cannot
be told to skip from here; use ``BlockSparseOptimizer(nonfinite="skip")`` for that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import blocks, codec
from tf_blocksparse.distribute.batches import is_gradient_batch
from tf_blocksparse.distribute.device_exchange import run_on_devices
from tf_blocksparse.exchange import selection_nbytes
from tf_blocksparse.feedback import compressor_for
from tf_blocksparse.options import (
    SPARSE_EXCHANGES,
    CompressionOptions,
    option_view,
    options_from,
)


class _ResidualState(tf.Module):
    """Trackable holder of the per-device residuals (``batches[i][device][gradient]``)."""

    def __init__(self) -> None:
        super().__init__(name="block_sparse_residuals")
        self.batches: list[list[list[tf.Variable]]] = []


class BlockSparseCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Block-sparse SUM of gradient batches across the devices of one process.

    Args:
      compression: A :class:`~tf_blocksparse.options.CompressionOptions` with a sparse
        ``exchange`` (``"allgather"``: each device its own blocks; ``"shared"``: blocks
        chosen from the scores summed over devices).  Not ``"auto"``, the options' default:
        these ops cannot measure the link, so name the mode.
      model: Optional Keras model whose ``trainable_variables`` the gradients belong to.
      **options: Alternatively, the arguments of ``CompressionOptions`` (``k``,
        ``density``, ``metric``, ``exchange``, ``granularity``, ``dense_below``,
        ``block_rules``); given so, ``exchange`` defaults to ``"allgather"``.

    Attributes:
      options: The :class:`~tf_blocksparse.options.CompressionOptions`; its fields are
        also readable as attributes (``k``, ``density``, ...).

    Raises:
      ValueError: A bad option (named), ``exchange`` ``"dense"`` or ``"auto"``,
        ``dense_steps`` (the optimizer wrapper's alone), or both ``compression`` and option
        keywords.
    """

    k = option_view("k", "options")
    density = option_view("density", "options")
    metric = option_view("metric", "options")
    exchange = option_view("exchange", "options")
    granularity = option_view("granularity", "options")
    dense_below = option_view("dense_below", "options")
    block_rules = property(lambda self: self.options.rules, doc="``options.rules``.")

    def __init__(self, compression: CompressionOptions | None = None, *, model: Any = None,
                 **options: Any):
        if compression is None:  # no measurement here: the keyword form names a mode
            options = {"exchange": "allgather", **options}
        self.options = options_from(compression, options, "BlockSparseCrossDeviceOps")
        if self.options.auto:
            raise ValueError(f"`exchange` must be one of {SPARSE_EXCHANGES} for "
                             "BlockSparseCrossDeviceOps, got 'auto' (the CompressionOptions "
                             "default): only BlockSparseOptimizer measures the link to choose")
        if not self.options.sparse:
            raise ValueError(f"`exchange` must be one of {SPARSE_EXCHANGES} for "
                             f"BlockSparseCrossDeviceOps, got {self.options.exchange!r}")
        if self.options.dense_steps:
            raise ValueError(f"`dense_steps` must be 0 for BlockSparseCrossDeviceOps, got "
                             f"{self.options.dense_steps}: only BlockSparseOptimizer counts "
                             "steps to end a dense phase")
        super().__init__()
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
        rules = self.options.rules
        variables = list(getattr(self._model, "trainable_variables", []) or [])
        if [tuple(v.shape) for v in variables] == list(shapes):
            return blocks.layouts_for(variables, self._model, rules)
        return [blocks.rule_for(f"gradient_{i}/{'kernel' if len(s) >= 2 else 'bias'}", s,
                                overrides=rules) for i, s in enumerate(shapes)]

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
        comp = compressor_for(self.options, layouts)
        state = self._state((tuple(devices), tuple(shapes)), devices, layouts, dtypes)
        updates = run_on_devices(devices, self.options.exchange, comp,
                                 [[v.values[d] for v in values] for d in range(len(devices))],
                                 state)
        self.payload_bytes = selection_nbytes(comp, dtypes)
        self.dense_bytes = sum(codec.buffer_nbytes(v.values[0]) for v in values)
        with tf.device(devices[0]):
            return [self.broadcast_implementation(u, dest)
                    for u, (_, dest) in zip(updates, value_destination_pairs)]
