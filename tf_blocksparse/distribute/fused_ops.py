"""``FusedCrossDeviceOps``: dense all-reduce of gradients following a balanced fusion plan.

Every plan group (a contiguous run of the backward order, see
:mod:`tf_blocksparse.planning.fusion`) becomes one fused reduction whose inputs are exactly
its members, so in the graph it can start as soon as its last member's gradient exists.
Sums are element-wise, so the result is bit-identical to the default one-device reduction.
Anything that is not a SUM batch of per-replica float tensors passes through unchanged.

With ``buffer_bytes``, the plan's execution order is derived from the model's forward pass
(:mod:`tf_blocksparse.keras.forward_order`) when the model is known (``model=`` or
:meth:`FusedCrossDeviceOps.bind_model`) and the gradient batch matches its trainable
variables' shapes; otherwise it falls back to the reverse of the batch order.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_blocksparse import codec
from tf_blocksparse.distribute.batches import is_gradient_batch
from tf_blocksparse.keras.forward_order import backward_ranks
from tf_blocksparse.planning.fusion import FusionPlan, plan_backward


class FusedCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Balanced-fusion dense all-reduce for ``MirroredStrategy``.

    Args:
      plan: A :class:`FusionPlan` over the gradient batch (indices = positions in the batch).
      buffer_bytes: Alternatively, the fusion buffer size; the balanced plan is made from the
        first gradient batch.
      model: Optional Keras model whose gradients are reduced (or :meth:`bind_model` later):
        with ``buffer_bytes``, its forward pass gives the execution order.
    """

    def __init__(self, plan: FusionPlan | None = None, buffer_bytes: int | None = None,
                 model: Any = None):
        if (plan is None) == (buffer_bytes is None):
            raise ValueError("give exactly one of `plan` and `buffer_bytes`")
        if buffer_bytes is not None and (not isinstance(buffer_bytes, int) or buffer_bytes < 1):
            raise ValueError(f"`buffer_bytes` must be an int >= 1, got {buffer_bytes!r}")
        if plan is not None:
            plan.validate()
        super().__init__()
        self.plan = plan
        self.buffer_bytes = buffer_bytes
        self.collectives_per_step = 0
        self.last_plan: FusionPlan | None = None  # the plan of the last gradient batch
        self._model: Any = None
        self._ranks: dict[tuple, list[int] | None] = {}  # variable shapes -> backward ranks
        if model is not None:
            self.bind_model(model)

    def bind_model(self, model: Any) -> None:
        """Names the Keras model whose gradients this reduces (the strategy, and so these
        ops, exist before the model).  If it is built, its backward order is derived now,
        eagerly; otherwise on the first gradient batch."""
        if not hasattr(model, "trainable_variables"):
            raise TypeError(f"`model` must be a Keras model, got {model!r}")
        self._model, self._ranks = model, {}
        if self.buffer_bytes is not None and model.trainable_variables:
            self._backward_ranks([tuple(v.shape) for v in model.trainable_variables])

    def _backward_ranks(self, shapes: list[tuple]) -> list[int] | None:
        """Backward ranks of the batch's gradients when it matches the model's variables."""
        variables = list(getattr(self._model, "trainable_variables", None) or [])
        if [tuple(v.shape) for v in variables] != shapes:
            return None
        key = tuple(shapes)
        if key not in self._ranks:
            self._ranks[key] = backward_ranks(self._model, variables)
        return self._ranks[key]

    def batch_reduce_implementation(self, reduce_op: Any, value_destination_pairs: Any,
                                    options: Any) -> list[Any]:
        values = [v for v, _ in value_destination_pairs]
        if not is_gradient_batch(reduce_op, values, min_devices=1):
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                       options)
        shapes = [tuple(v.values[0].shape) for v in values]
        dtypes = [v.values[0].dtype for v in values]
        plan = self.plan
        if plan is None or len(plan.tensors) != len(values):
            if self.plan is not None:
                raise ValueError(f"`plan` covers {len(plan.tensors)} tensors, the gradient "
                                 f"batch has {len(values)}")
            ranks = self._backward_ranks(shapes)
            order = None if ranks is None else sorted(range(len(values)), key=ranks.__getitem__)
            plan = plan_backward([codec.buffer_nbytes(v.values[0]) for v in values],
                                 [dt.name for dt in dtypes], self.buffer_bytes, order=order)
        devices = [t.device for t in values[0].values]
        results: list[Any] = [None] * len(values)
        for group in plan.groups:
            members = list(group.members)
            per_device = []
            for d, dev in enumerate(devices):
                with tf.device(dev):
                    parts = [tf.reshape(values[i].values[d], [-1]) for i in members]
                    per_device.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
            with tf.device(devices[0]):
                summed = tf.add_n([tf.identity(p) for p in per_device])
                sizes = [int(tf.TensorShape(shapes[i]).num_elements()) for i in members]
                for i, piece in zip(members, tf.split(summed, sizes) if len(sizes) > 1
                                    else [summed]):
                    results[i] = self.broadcast_implementation(
                        tf.reshape(piece, shapes[i]), value_destination_pairs[i][1])
        self.collectives_per_step = len(plan.groups)
        self.last_plan = plan
        return results
