"""Every change ``BlockSparseOptimizer`` makes to the Keras optimizers it wraps, in one place.

The wrapper owns its inner optimizer (and, with ``sync_every``, its outer one); these are the
only ways it touches them, each a function here:

1. :func:`take_over`: their own cross-replica gradient sum is switched off
   (:func:`tf_blocksparse._compat.disable_gradient_all_reduce`): the wrapper's exchange
   replaces it, so they apply the exchanged update as it arrives.
2. :func:`move_momentum`: with ``momentum_correction="auto"`` and a sparse exchange, an inner
   ``SGD(momentum=m)``'s momentum is moved before the exchange: its own is set to 0 before it
   is built (no momentum slots; :meth:`MomentumCorrection.resolve
   <tf_blocksparse.keras.momentum.MomentumCorrection.resolve>`).
3. :func:`momentum_in_dense_groups`: with an exchange whose modes change (``exchange="auto"``,
   ``dense_steps``) and local momentum over a plain inner ``SGD``, the inner SGD gets the
   factor back and applies it to the variables of densely exchanged groups only
   (:func:`tf_blocksparse._compat.momentum_only_where`): a dense group's momentum is the
   inner's, a sparse group's the per-replica velocities.
4. :func:`inner_config`: the wrapper's config holds the inner optimizer with momentum 0 in
   case 3 (the factor is the policy's), so a loaded wrapper repeats 2 and 3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from tf_blocksparse import _compat

__all__ = ["inner_config", "momentum_in_dense_groups", "move_momentum", "take_over"]


def take_over(inner: keras.optimizers.Optimizer,
              outer: keras.optimizers.Optimizer | None = None) -> None:
    """Switches off the gradient all-reduce of ``inner`` and ``outer`` (when given)."""
    for optimizer in (inner, outer):
        if optimizer is not None:
            _compat.disable_gradient_all_reduce(optimizer)


def move_momentum(inner: keras.optimizers.Optimizer) -> float:
    """Sets an inner SGD's momentum to 0 (read by its ``build``: no momentum slots) and
    returns the factor it had."""
    momentum = float(inner.momentum)
    inner.momentum = 0.0
    return momentum


def momentum_in_dense_groups(inner: keras.optimizers.Optimizer, momentum: float,
                             in_dense_group: Callable[[int], bool]) -> None:
    """Gives an inner SGD the factor ``momentum`` for the variables (by index) that
    ``in_dense_group`` accepts when its step is traced; the others take plain steps."""
    inner.momentum = momentum
    _compat.momentum_only_where(inner, in_dense_group)


def inner_config(inner: keras.optimizers.Optimizer, dense_groups_momentum: bool
                 ) -> dict[str, Any]:
    """The serialised inner optimizer, its momentum 0 where the wrapper gave it the
    factor of the dense groups (:func:`momentum_in_dense_groups`)."""
    config = keras.saving.serialize_keras_object(inner)
    if dense_groups_momentum:  # the policy's factor
        config["config"]["momentum"] = 0.0
    return config
