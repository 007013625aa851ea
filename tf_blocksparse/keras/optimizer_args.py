"""Argument checks and small helpers of ``BlockSparseOptimizer``."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import blocks, selection
from tf_blocksparse import clipping as clipping_lib
from tf_blocksparse import exchange as exchange_lib
from tf_blocksparse.feedback import (
    DEFAULT_DENSE_BELOW,
    BlockTopK,
    ElementTopK,
    validate_dense_below,
    validate_k_density,
)
from tf_blocksparse.keras.optimizer_step import MASKINGS

NONFINITE = ("skip", "apply")
#: Default of ``dense_below`` (see :data:`tf_blocksparse.feedback.DEFAULT_DENSE_BELOW`).
DENSE_BELOW = DEFAULT_DENSE_BELOW
#: Default of ``momentum_correction``: move an inner SGD's momentum before the exchange.
AUTO = "auto"
GRANULARITIES = {"block": BlockTopK, "element": ElementTopK}


def no_all_reduce(grads_and_vars: Any) -> list:
    """Replaces the inner optimizer's all-reduce: the wrapper already exchanged."""
    return list(grads_and_vars)


@tf.autograph.experimental.do_not_convert
def discover_owners(variables: Sequence[Any]) -> dict[int, Any]:
    """Maps ``id(variable)`` to the live Keras layer that created it.

    The optimizer only sees variables, but the block-rule table needs each one's layer class
    (a renamed ``Conv2DTranspose`` kernel must not be split like a ``Conv2D`` kernel).  One
    pass over the garbage collector's live objects at build time finds the layers.
    """
    wanted = {id(v) for v in variables}
    owners: dict[int, Any] = {}
    for obj in gc.get_objects():
        if isinstance(obj, keras.layers.Layer):
            for v in getattr(obj, "_trainable_variables", ()):
                if id(v) in wanted:
                    owners.setdefault(id(v), obj)
    return owners


def densify(g: Any, v: Any) -> tf.Tensor:
    """Dense gradient with the variable's static shape (IndexedSlices are summed per row;
    a gradient whose static shape TF lost, e.g. a Dense kernel on rank-3 input, gets it back).
    """
    if isinstance(g, tf.IndexedSlices):
        g = tf.math.unsorted_segment_sum(g.values, g.indices, g.dense_shape[0])
    return tf.ensure_shape(tf.convert_to_tensor(g), v.shape)


def auto_momentum(inner: keras.optimizers.Optimizer, exchange: str) -> float | None:
    """What ``momentum_correction="auto"`` becomes: the inner SGD's momentum, moved.

    With a sparse exchange and an inner ``SGD(momentum=m)`` (not Nesterov) the momentum is
    kept per replica before the exchange (``m``) and the inner SGD's own is set to 0.  With
    any other inner optimizer, Nesterov, or the dense exchange (where both forms are the
    same math) nothing moves: ``None``.
    """
    m = float(getattr(inner, "momentum", 0.0) or 0.0)
    if exchange == "dense" or not isinstance(inner, keras.optimizers.SGD) or m <= 0.0 \
            or getattr(inner, "nesterov", False) or not m < 1.0:
        return None
    inner.momentum = 0.0  # read by SGD.build: no momentum slots, the wrapper keeps them
    return m


def check_momentum_correction(value: Any, inner: keras.optimizers.Optimizer
                               ) -> float | None:
    """Validates ``momentum_correction``; returns it as a float (``None``: off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"`momentum_correction` must be 'auto', None or a float in [0, 1), "
                         f"got {value!r}")
    inner_momentum = float(getattr(inner, "momentum", 0.0) or 0.0)
    if value and inner_momentum:
        raise ValueError(f"`momentum_correction` keeps the momentum per replica before the "
                         f"exchange, so the inner optimizer must have none; got inner "
                         f"momentum={inner_momentum}")
    return float(value)


def validate_arguments(inner: Any, k: Any, density: Any, metric: Any, exchange: Any,
                       nonfinite: Any, block_rules: Any, granularity: Any,
                       fusion_buffer_bytes: Any, clipping: Any, momentum_correction: Any,
                       dense_below: Any, momentum_masking: Any, kwargs: dict[str, Any]
                       ) -> tuple[Any, Any, list, float | None, int]:
    """Checks ``BlockSparseOptimizer``'s arguments before anything is built.

    Returns:
      ``(k, density, clipping rules, momentum_correction, dense_below)`` normalised.

    Raises:
      TypeError / ValueError naming the argument.
    """
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(f"`inner` must be a keras.optimizers.Optimizer, got {inner!r}")
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError("`inner` must not be a LossScaleOptimizer: use "
                        "LossScaleOptimizer(BlockSparseOptimizer(...)) instead")
    k, density = validate_k_density(k, density)
    if metric not in selection.METRICS:
        raise ValueError(f"`metric` must be one of {selection.METRICS}, got {metric!r}")
    if exchange not in exchange_lib.EXCHANGES:
        raise ValueError(f"`exchange` must be one of {exchange_lib.EXCHANGES}, "
                         f"got {exchange!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"`granularity` must be one of {sorted(GRANULARITIES)}, "
                         f"got {granularity!r}")
    if fusion_buffer_bytes is not None and (
            isinstance(fusion_buffer_bytes, bool) or not isinstance(fusion_buffer_bytes, int)
            or fusion_buffer_bytes < 1):
        raise ValueError(f"`fusion_buffer_bytes` must be an int >= 1, got "
                         f"{fusion_buffer_bytes!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"`nonfinite` must be one of {NONFINITE}, got {nonfinite!r}")
    for rule in (block_rules or {}).values():
        blocks._as_rule(rule, "block_rules")
    rules = clipping_lib.as_rules(clipping)
    auto = isinstance(momentum_correction, str) and momentum_correction == AUTO
    if not auto:
        momentum_correction = check_momentum_correction(momentum_correction, inner)
    dense_below = validate_dense_below(dense_below)
    if momentum_masking not in MASKINGS:
        raise ValueError(f"`momentum_masking` must be one of {MASKINGS}, got "
                         f"{momentum_masking!r}")
    kwargs.pop("learning_rate", None)
    if kwargs:
        raise ValueError(f"BlockSparseOptimizer does not take {sorted(kwargs)}; set them "
                         "on the inner optimizer")
    if auto:  # last: it changes the inner optimizer, so only once every check passed
        momentum_correction = auto_momentum(inner, exchange)
    return k, density, rules, momentum_correction, dense_below
