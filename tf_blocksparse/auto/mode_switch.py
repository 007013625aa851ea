"""Where an automatic exchange's state goes when a fusion group changes mode.

With ``exchange="auto"`` over an inner ``SGD`` a group's momentum lives in the inner SGD
while the group is dense (``M = -lr v``, Keras' form, ``v`` the summed momentum) and in the
per-replica velocities ``u`` while it is sparse (momentum correction before the exchange,
``sum(u) = v``); a sparse group also holds per-replica residuals ``r``: exchanged updates
not yet sent, each to be applied once, without further momentum.

Both moves run eagerly in cross-replica context, on every worker together (they read
per-replica state, a collective), when the modes change:

- :func:`to_velocities` (dense -> sparse): ``u += -M / (lr N)`` on each of the ``N``
  replicas, ``M = 0`` (a dense group's ``u`` is zero, so that is ``u = -M / (lr N)``; after
  a restore in the sparse mode ``M`` is zero and the restored ``u`` stays);
- :func:`flush_to_weights` (sparse -> dense): ``w -= lr sum(r)``, ``M = -lr sum(u)``, then
  ``r = u = 0``, so the dense steps need no per-replica state at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import codec

__all__ = ["flushes_at_switch", "flush_to_weights", "to_velocities"]


def flushes_at_switch(inner: keras.optimizers.Optimizer, momentum_moves: bool) -> bool:
    """Whether a group entering the dense exchange can be flushed at the switch.

    True for a plain ``SGD`` (not Nesterov, no gradient clipping or loss scaling of its own)
    whose momentum, if any, is the one the wrapper moves between the modes
    (``momentum_moves``): its update of an exchanged sum ``x`` is ``-lr x`` plus the
    momentum, so a residual can be applied to the weights directly.  Any other inner
    optimizer must see the residual as a gradient: the group's first dense step then sends
    ``grad + residual`` instead.
    """
    return (isinstance(inner, keras.optimizers.SGD) and not inner.nesterov
            and (momentum_moves or not inner.momentum)
            and all(getattr(inner, a, None) is None
                    for a in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")))


def _learning_rate(inner: keras.optimizers.Optimizer) -> float:
    return float(tf.convert_to_tensor(inner.learning_rate).numpy())


def _summed(strategy: tf.distribute.Strategy, states: Sequence[keras.Variable]
            ) -> list[tf.Tensor]:
    """Every replica's ``states`` summed, in one all-reduce (float64 on the wire)."""
    if not states:
        return []

    def local() -> tf.Tensor:
        return codec.pack([tf.cast(tf.convert_to_tensor(s.value), tf.float64) for s in states])

    flat = strategy.reduce("SUM", strategy.run(local), axis=None)
    return [tf.cast(t, s.dtype)
            for t, s in zip(codec.unpack(flat, [tuple(s.shape) for s in states]), states)]


def _zero(strategy: tf.distribute.Strategy, states: Sequence[keras.Variable]) -> None:
    def replica_fn() -> None:
        for s in states:
            s.value.assign(tf.zeros_like(s.value))

    strategy.run(replica_fn)


def to_velocities(strategy: tf.distribute.Strategy, inner: keras.optimizers.Optimizer,
                  velocities: Sequence[keras.Variable], variables: Sequence[int]) -> None:
    """Moves the inner SGD's momentum of ``variables`` (indices) into the per-replica
    velocities: ``u += -M / (lr N)`` on every replica, then ``M = 0``."""
    if not variables:
        return
    lr = _learning_rate(inner)
    scale = 0.0 if lr == 0.0 else -1.0 / (lr * strategy.num_replicas_in_sync)

    def replica_fn() -> None:
        for i in variables:
            m = tf.convert_to_tensor(inner.momentums[i])
            velocities[i].value.assign_add(tf.cast(scale, m.dtype) * m)

    with strategy.scope():
        strategy.run(replica_fn)
        for i in variables:
            inner.momentums[i].assign(tf.zeros_like(inner.momentums[i]))


def flush_to_weights(strategy: tf.distribute.Strategy, inner: keras.optimizers.Optimizer,
                     weights: Sequence[Any], residuals: Sequence[keras.Variable],
                     velocities: Sequence[keras.Variable], variables: Sequence[int],
                     momentum_moves: bool) -> None:
    """Flushes the per-replica state of ``variables`` (indices) for the dense exchange.

    ``w -= lr sum(r)`` (the residual applied once, as its sparse exchange would have), and
    with ``momentum_moves`` the inner SGD's ``M = -lr sum(u)`` (the momentum continues);
    then residuals and velocities are zero on every replica.

    Args:
      strategy: The strategy the state lives under.
      inner: The inner ``SGD`` (see :func:`flushes_at_switch`).
      weights: The trained variables, by index.
      residuals: Per variable its per-replica residual.
      velocities: Per variable its per-replica velocity (empty without momentum correction).
      variables: The indices to flush.
      momentum_moves: Whether the velocities move into the inner SGD's momentum.
    """
    if not variables:
        return
    lr = _learning_rate(inner)
    with strategy.scope():
        rs = [residuals[i] for i in variables]
        us = [velocities[i] for i in variables] if velocities else []
        summed = _summed(strategy, rs + us)
        for i, r in zip(variables, summed[:len(rs)]):
            weights[i].assign_sub(tf.cast(lr, r.dtype) * r)
        if momentum_moves:
            for i, u in zip(variables, summed[len(rs):]):
                inner.momentums[i].assign(tf.cast(-lr, u.dtype) * u)
        _zero(strategy, rs + us)
