"""What ``BlockSparseOptimizer`` takes from Keras: each replica's gradients, checked and
densified for ``apply`` (:func:`replica_gradients`), and the layers that own the variables
for the block-rule table at ``build`` (:func:`discover_owners`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import _compat

__all__ = ["densify", "discover_owners", "replica_gradients"]


@tf.autograph.experimental.do_not_convert
def discover_owners(variables: Sequence[Any], optimizer: Any = None) -> dict[int, Any]:
    """Maps ``id(variable)`` to the live Keras layer that created it.

    The optimizer only sees variables, but the block-rule table needs each one's layer class
    (a renamed ``Conv2DTranspose`` kernel must not be split like a ``Conv2D`` kernel).  When
    a Keras model is building ``optimizer`` (``model.fit``), its layers are searched;
    variables not found there (and every variable in a custom loop) are looked up in one
    pass over the garbage collector's live objects, whose cost grows with the program's
    objects.
    """
    variables = list(variables)
    owners: dict[int, Any] = {}
    model = None if optimizer is None else _compat.calling_model(optimizer)
    if model is not None:
        owners = _compat.variable_owners(variables, [model, *_compat.flatten_layers(model)])
    missing = [v for v in variables if id(v) not in owners]
    if missing:
        owners.update(_compat.variable_owners(missing))
    return owners


def densify(g: Any, v: Any) -> tf.Tensor:
    """Dense gradient with the variable's dtype and static shape.

    ``apply`` runs it once per gradient before anything else, so every exchange mode, error
    feedback and the local momentum see the variable's dtype (as Keras, which casts each
    gradient, and a dense exchange would): a float64 gradient of a float32 variable is cast.
    IndexedSlices are summed per row; a gradient whose static shape TF lost (e.g. a Dense
    kernel on rank-3 input) gets it back.
    """
    dtype = tf.as_dtype(v.dtype)
    if isinstance(g, tf.IndexedSlices):
        g = tf.math.unsorted_segment_sum(tf.cast(g.values, dtype), g.indices,
                                         g.dense_shape[0])
    return tf.ensure_shape(tf.cast(tf.convert_to_tensor(g), dtype), v.shape)


def replica_gradients(grads: Sequence[Any], variables: Sequence[Any]
                      ) -> tuple[list[tf.Tensor], list[Any]]:
    """The gradients ``apply`` exchanges, checked: the pairs with a gradient, densified
    (:func:`densify`).

    Args:
      grads: One gradient (or ``None``) per variable, this replica's own.
      variables: The variables they belong to.

    Returns:
      The dense gradients and their variables, without the ``None`` gradients' pairs.

    Raises:
      ValueError: The counts differ, or ``apply`` was called in cross-replica context.
    """
    if len(grads) != len(variables):
        raise ValueError(f"got {len(grads)} gradients for {len(variables)} variables")
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context (inside "
                         "strategy.run or model.fit)")
    pairs = [(densify(g, v), v) for g, v in zip(grads, variables) if g is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]
