"""``BlockSparseCrossDeviceOps``: the project's exchange for ``MirroredStrategy``, in fusion
buckets, dense or block-sparse.

``tf.distribute.MirroredStrategy(cross_device_ops=tfbs.BlockSparseCrossDeviceOps(k=1))``
with a *plain* Keras optimizer: the optimizer's gradient all-reduce (a SUM ``batch_reduce`` of
per-replica float tensors) goes through the bucketed exchange hook
(:mod:`tf_blocksparse.hooks`) over the devices, composed of two independent parts:

*what* is sent, ``compression``
    A :class:`~tf_blocksparse.options.CompressionOptions`: per device error feedback + block
    top-k selection and the sum of every device's selected blocks, the same exchange as
    ``BlockSparseOptimizer``; or ``None``: the dense sum (bit-identical to the default
    one-device reduction, sums being element-wise).
*in which buckets*, ``fusion``
    A :class:`~tf_blocksparse.fusion.FusionPlan` over the batch, or a buffer size
    in bytes from which the balanced plan is made in backward order (derived from the
    model's forward pass, :mod:`tf_blocksparse.fusion.forward_order`, when the model is
    known and the batch matches its trainable variables; else the reverse of the batch
    order); or ``None``: one bucket of every variable.  Every bucket is one fused set of
    collectives whose inputs are exactly its members, so in the graph it can start as soon
    as its last member's gradient exists.  Selection is per variable, so the buckets do not
    change which blocks are sent.

Everything else -- single ``reduce`` calls (metrics, ``strategy.reduce``), MEAN reductions,
integer values, ``all_gather`` -- is a dense pass-through (reduce to one device, then
broadcast); with compression, so are batches of a single device.

Variables are identified by position and shape in the gradient batch; give ``model=`` (or
:meth:`BlockSparseCrossDeviceOps.bind_model`) so the block-rule table sees their layer
classes (otherwise rank-2+ tensors split along the last axis, vectors per element) and the
fusion planner their backward order.

Checkpoints: the residuals are owned by this object (one variable per device and gradient,
created on first use) and hang off :attr:`BlockSparseCrossDeviceOps.state`, a ``tf.Module``;
put it in a ``tf.train.Checkpoint`` beside the model and optimizer
(``tf.train.Checkpoint(model=m, optimizer=o, residuals=ops.state)``).  Restoring before the
first step works: the residuals are created on first use and take the restored values then.

Non-finite gradients: when any device's accumulated gradient (gradient + residual) holds a
NaN or Inf in any bucket, every residual is left unchanged and the *dense* sum goes to the
optimizer (so its values are non-finite, as with the default reduction, and a
``LossScaleOptimizer`` skips the step).  A plain optimizer cannot be told to skip from
here; use ``BlockSparseOptimizer(nonfinite="skip")`` for that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import blocks, codec
from tf_blocksparse.distribute.batches import GradientBatch, ModelBinding, is_gradient_batch
from tf_blocksparse.distribute.device_exchange import exchange_on_devices, sum_on_devices
from tf_blocksparse.exchange_bytes import selection_nbytes
from tf_blocksparse.feedback import compressor_for
from tf_blocksparse.fusion import FusionPlan, plan_backward
from tf_blocksparse.options import SPARSE_EXCHANGES, CompressionOptions, options_from

__all__ = ["BlockSparseCrossDeviceOps"]


class _ResidualState(tf.Module):
    """Trackable holder of the per-device residuals (``batches[i][device][gradient]``)."""

    def __init__(self) -> None:
        super().__init__(name="block_sparse_residuals")
        self.batches: list[list[list[tf.Variable]]] = []


def _options(compression: CompressionOptions | None, keywords: dict[str, Any]
             ) -> CompressionOptions | None:
    """The checked sparse options, or ``None`` (dense) when neither form is given."""
    if compression is None and not keywords:
        return None
    if compression is None:  # no measurement here: the keyword form names a mode
        keywords = {"exchange": "allgather", **keywords}
    options = options_from(compression, keywords, "BlockSparseCrossDeviceOps")
    if options.auto:
        raise ValueError(f"`exchange` must be one of {SPARSE_EXCHANGES} for "
                         "BlockSparseCrossDeviceOps, got 'auto' (the CompressionOptions "
                         "default): only BlockSparseOptimizer measures the link to choose")
    if not options.sparse:
        raise ValueError(f"`exchange` must be one of {SPARSE_EXCHANGES} for "
                         f"BlockSparseCrossDeviceOps, got {options.exchange!r} (for the "
                         "dense sum pass compression=None)")
    if options.dense_steps:
        raise ValueError(f"`dense_steps` must be 0 for BlockSparseCrossDeviceOps, got "
                         f"{options.dense_steps}: only BlockSparseOptimizer counts "
                         "steps to end a dense phase")
    return options


def _fusion(fusion: FusionPlan | int | None) -> tuple[FusionPlan | None, int | None]:
    """``(plan, buffer_bytes)`` of the ``fusion`` argument."""
    if fusion is None:
        return None, None
    if isinstance(fusion, FusionPlan):
        fusion.validate()
        return fusion, None
    if isinstance(fusion, bool) or not isinstance(fusion, int) or fusion < 1:
        raise ValueError(f"`fusion` must be a FusionPlan, a buffer size in bytes (an int "
                         f">= 1) or None, got {fusion!r}")
    return None, fusion


def _option(name: str) -> property:
    return property(lambda self: None if self.options is None else getattr(self.options, name),
                    doc=f"``options.{name}`` (``None`` for the dense sum).")


class BlockSparseCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Bucketed, dense or block-sparse SUM of gradient batches across one process's devices.

    Args:
      compression: A :class:`~tf_blocksparse.options.CompressionOptions` with a sparse
        ``exchange`` (``"allgather"``: each device its own blocks; ``"shared"``: blocks
        chosen from the scores summed over devices), or ``None`` (and no option keywords)
        for the dense sum.  Not ``"auto"``, the options' default: these ops cannot measure
        the link, so name the mode.
      fusion: A :class:`~tf_blocksparse.fusion.FusionPlan` over the gradient batch
        (members = positions in the batch), a fusion buffer size in bytes (the balanced
        plan is made from each new gradient batch), or ``None``: one bucket.
      model: Optional Keras model whose ``trainable_variables`` the gradients belong to (or
        :meth:`bind_model` later).
      **options: Alternatively, the arguments of ``CompressionOptions`` (``k``,
        ``density``, ``metric``, ``exchange``, ``granularity``, ``dense_below``,
        ``block_rules``); given so, ``exchange`` defaults to ``"allgather"``.

    Attributes:
      options: The :class:`~tf_blocksparse.options.CompressionOptions`, or ``None`` for the
        dense sum; its fields are also readable as attributes (``k``, ``density``, ...).
      plan: The fusion plan given, or ``None``.
      buffer_bytes: The fusion buffer size given, or ``None``.
      last_plan: The plan of the last gradient batch (``None`` without fusion).
      collectives_per_step: Buckets of the last gradient batch.
      payload_bytes: Bytes per device per step of the last gradient batch traced.
      dense_bytes: Bytes of a dense sum of that batch.

    Raises:
      ValueError: A bad option (named), ``exchange`` ``"dense"`` or ``"auto"``,
        ``dense_steps`` (the optimizer wrapper's alone), both ``compression`` and option
        keywords, or a bad ``fusion``.
      TypeError: ``model`` is not a Keras model.
    """

    k = _option("k")
    density = _option("density")
    metric = _option("metric")
    exchange = _option("exchange")
    granularity = _option("granularity")
    dense_below = _option("dense_below")
    block_rules = property(lambda self: None if self.options is None else self.options.rules,
                           doc="``options.rules``.")

    def __init__(self, compression: CompressionOptions | None = None, *,
                 fusion: FusionPlan | int | None = None, model: Any = None, **options: Any):
        self.options = _options(compression, options)
        self.plan, self.buffer_bytes = _fusion(fusion)
        super().__init__()
        self.binding = ModelBinding()
        self._residuals: dict[tuple, list[list[tf.Variable]]] = {}
        self.state = _ResidualState()
        self.payload_bytes = 0  # per device per step, set when a gradient batch is traced
        self.dense_bytes = 0
        self.collectives_per_step = 0
        self.last_plan: FusionPlan | None = None
        if model is not None:
            self.bind_model(model)

    def bind_model(self, model: Any) -> None:
        """Names the Keras model whose gradients this reduces (the strategy, and so these
        ops, exist before the model; call this once the model is built, before training).
        With a fusion buffer size and a built model, its backward order is derived now,
        eagerly; otherwise on the first gradient batch.

        Raises:
          TypeError: ``model`` is not a Keras model.
        """
        self.binding.bind(model)
        if self.buffer_bytes is not None and model.trainable_variables:
            self.binding.backward_ranks([tuple(v.shape) for v in model.trainable_variables])

    @property
    def residuals(self) -> dict[tuple, list[list[tf.Variable]]]:
        """``{batch signature: [per device [per gradient residual variable]]}``."""
        return self._residuals

    def _state(self, batch: GradientBatch, layouts: Sequence[blocks.BlockLayout]
               ) -> list[list[tf.Variable]]:
        key = (batch.devices, batch.shapes)
        if key not in self._residuals:
            per_device = []
            with tf.init_scope():  # created once, eagerly, even when first seen in a trace
                for d, dev in enumerate(batch.devices):
                    with tf.device(dev):
                        per_device.append([
                            tf.Variable(tf.zeros(lay.shape, dt), trainable=False,
                                        name=f"residual_{i}_replica_{d}")
                            for i, (lay, dt) in enumerate(zip(layouts, batch.dtypes))])
            with tf.init_scope():  # tracking restores values from a pending checkpoint
                self.state.batches.append(per_device)
                self._residuals[key] = self.state.batches[-1]
        return self._residuals[key]

    def _plan(self, batch: GradientBatch) -> FusionPlan | None:
        """The fusion plan of ``batch`` (``None``: one bucket)."""
        n = len(batch.shapes)
        if self.plan is not None:
            if len(self.plan.tensors) != n:
                raise ValueError(f"`fusion` plan covers {len(self.plan.tensors)} tensors, "
                                 f"the gradient batch has {n}")
            return self.plan
        if self.buffer_bytes is None:
            return None
        ranks = self.binding.backward_ranks(batch.shapes)
        order = None if ranks is None else sorted(range(n), key=ranks.__getitem__)
        return plan_backward([codec.buffer_nbytes(g) for g in batch.grads[0]],
                             [dt.name for dt in batch.dtypes], self.buffer_bytes, order=order)

    def batch_reduce_implementation(self, reduce_op: Any, value_destination_pairs: Any,
                                    options: Any) -> list[Any]:
        values = [v for v, _ in value_destination_pairs]
        min_devices = 1 if self.options is None else 2
        if not is_gradient_batch(reduce_op, values, min_devices=min_devices):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                       options)
        batch = GradientBatch.of(values)
        plan = self._plan(batch)
        groups = [list(g.members) for g in plan.groups] if plan else [range(len(values))]
        self.dense_bytes = sum(codec.buffer_nbytes(g) for g in batch.grads[0])
        if self.options is None:
            updates = sum_on_devices(batch.devices, batch.grads, groups)
            self.payload_bytes = self.dense_bytes
        else:
            layouts = self.binding.layouts(batch.shapes, self.options.rules)
            updates = exchange_on_devices(
                batch.devices, self.options.exchange,
                lambda bucket: compressor_for(self.options, bucket.layouts), batch.grads,
                self._state(batch, layouts), groups, layouts)
            self.payload_bytes = sum(
                selection_nbytes(compressor_for(self.options, [layouts[i] for i in g]),
                                 [batch.dtypes[i] for i in g]) for g in groups)
        self.collectives_per_step = len(groups)
        self.last_plan = plan
        with tf.device(batch.devices[0]):
            return [self.broadcast_implementation(u, dest)
                    for u, (_, dest) in zip(updates, value_destination_pairs)]
