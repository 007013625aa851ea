"""Which cross-device reductions are gradient batches, and the model they belong to.

Shared by the custom ops: :func:`is_gradient_batch` picks the optimizer's gradient
all-reduce out of the strategy's reductions, :class:`GradientBatch` holds it per device, and
:class:`ModelBinding` matches it to the bound Keras model (block layouts, backward order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import blocks
from tf_blocksparse.fusion.forward_order import backward_ranks


def is_gradient_batch(reduce_op: Any, values: Sequence[Any], min_devices: int = 1) -> bool:
    """True for a SUM batch of per-replica, dense, floating, fully-shaped tensors.

    That is what an optimizer's gradient all-reduce hands to ``batch_reduce``; metrics,
    ``strategy.reduce`` calls, MEAN reductions, integers and ``IndexedSlices`` are not.

    Args:
      reduce_op: The reduction.
      values: The batch's distributed values.
      min_devices: Fewest per-replica components a value must have.
    """
    if reduce_op != tf.distribute.ReduceOp.SUM or not values:
        return False
    for v in values:
        locals_ = getattr(v, "values", None)
        if not isinstance(v, tf.distribute.DistributedValues) or locals_ is None \
                or len(locals_) < min_devices or isinstance(locals_[0], tf.IndexedSlices):
            return False
        t = locals_[0]
        if not t.dtype.is_floating or not t.shape.is_fully_defined():
            return False
    return True


@dataclasses.dataclass(frozen=True)
class GradientBatch:
    """A gradient batch as the custom ops see it.

    Attributes:
      devices: One device per replica.
      shapes: Per position, the gradient's shape.
      dtypes: Per position, its dtype.
      grads: ``grads[d][v]``: device ``d``'s gradient of position ``v`` [*shape_v].
    """

    devices: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[tf.DType, ...]
    grads: tuple[tuple[tf.Tensor, ...], ...]

    @classmethod
    def of(cls, values: Sequence[Any]) -> GradientBatch:
        """The batch of ``values`` (checked by :func:`is_gradient_batch`)."""
        devices = tuple(t.device for t in values[0].values)
        return cls(devices, tuple(tuple(v.values[0].shape) for v in values),
                   tuple(v.values[0].dtype for v in values),
                   tuple(tuple(v.values[d] for v in values) for d in range(len(devices))))


class ModelBinding:
    """The Keras model whose gradients a ``CrossDeviceOps`` reduces, matched to a batch.

    The strategy, and so its ops, exist before the model: :meth:`bind` names it later.  A
    gradient batch belongs to the model when its shapes are those of the model's
    ``trainable_variables``, in order; then the block-rule table sees the variables' layer
    classes and the fusion planner their backward order.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self._ranks: dict[tuple, list[int] | None] = {}  # variable shapes -> backward ranks

    def bind(self, model: Any) -> None:
        """Names ``model``.

        Raises:
          TypeError: ``model`` has no ``trainable_variables``.
        """
        if not hasattr(model, "trainable_variables"):
            raise TypeError(f"`model` must be a Keras model, got {model!r}")
        self.model, self._ranks = model, {}

    def variables(self, shapes: Sequence[tuple[int, ...]]) -> list[Any] | None:
        """The model's trainable variables when the batch of ``shapes`` matches them."""
        variables = list(getattr(self.model, "trainable_variables", None) or [])
        if [tuple(v.shape) for v in variables] != [tuple(s) for s in shapes]:
            return None
        return variables

    def layouts(self, shapes: Sequence[tuple[int, ...]], rules: Any = None
                ) -> list[blocks.BlockLayout]:
        """Per position the block layout: from the model's layers when the batch matches,
        else from the shape alone (rank 2+ split along the last axis, vectors per element).
        """
        variables = self.variables(shapes)
        if variables is not None:
            return blocks.layouts_for(variables, self.model, rules)
        return [blocks.rule_for(f"gradient_{i}/{'kernel' if len(s) >= 2 else 'bias'}", s,
                                overrides=rules) for i, s in enumerate(shapes)]

    def backward_ranks(self, shapes: Sequence[tuple[int, ...]]) -> list[int] | None:
        """Per position its rank in the backward order derived from the model's forward
        pass (:func:`~tf_blocksparse.fusion.forward_order.backward_ranks`), or ``None``
        when the batch does not match the model or its order cannot be derived."""
        variables = self.variables(shapes)
        if variables is None:
            return None
        key = tuple(tuple(s) for s in shapes)
        if key not in self._ranks:
            self._ranks[key] = backward_ranks(self.model, variables)
        return self._ranks[key]
