"""Gradient transforms with explicit state, composed by ``BlockSparseOptimizer``'s step.

A step of the wrapper is a sequence of transforms of each replica's local gradients, in the
manner of optax::

    grads, clip_state = clipping.update(grads, clip_state, params)       # optional
    grads, velocities = momentum.update(grads, velocities, params)       # optional
    result = exchange(grads, residuals)                                  # per bucket
    velocities = momentum.mask(velocities, result)                       # factor masking
    commit(clip_state, residuals, velocities) if finite; inner.apply(result.updates)

A transform (:class:`GradientTransform`) owns no variable: :meth:`~GradientTransform.init`
creates its per-variable state through a factory the optimizer passes (per-replica
variables, tracked and saved by the optimizer), and :meth:`~GradientTransform.update` maps the
step's gradients and the values of their state to new gradients and new state values, which
the optimizer commits only when the step is finite.  A position whose state is ``None``
carries no state in this step (a group the automatic exchange sends densely after a flush):
its gradient passes through and its new state is ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import keras
import tensorflow as tf

from tf_blocksparse import clipping as clipping_lib
from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.keras.momentum import MomentumCorrection

__all__ = ["ClippingTransform", "GradientTransform", "MomentumTransform", "NewState",
           "read_state", "state_commits"]

#: ``new_state(variable, shape, dtype, prefix)``: a zero-initialised per-replica state
#: variable next to ``variable``, tracked by the optimizer.
NewState = Callable[[Any, tuple[int, ...], str, str], keras.Variable]
#: Per position of the step, the values of its state variables (``None``: no state now).
StateValues = list[list[tf.Tensor] | None]


class GradientTransform(Protocol):
    """A per-replica transform of the local gradients with explicit per-variable state."""

    def init(self, variables: Sequence[Any], new_state: NewState
             ) -> list[list[keras.Variable]]:
        """Creates the state: per variable of ``variables``, its state variables."""

    def update(self, grads: Sequence[tf.Tensor], state: StateValues,
               params: Sequence[Any], idx: Sequence[int]
               ) -> tuple[list[tf.Tensor], StateValues]:
        """The transformed ``grads`` (of the variables ``params``, indices ``idx``) and the
        new values of their ``state``."""


def read_state(variables: Sequence[Sequence[keras.Variable]], positions: Sequence[bool]
               ) -> StateValues:
    """The values of the state ``variables`` per position, ``None`` where ``positions`` is
    false (no state in this step)."""
    return [[tf.convert_to_tensor(s.value) for s in vs] if live else None
            for vs, live in zip(variables, positions)]


def state_commits(variables: Sequence[Sequence[keras.Variable]], values: StateValues
                  ) -> list[tuple[keras.Variable, tf.Tensor]]:
    """``(variable, new value)`` pairs of a transform's new state (``None`` positions
    skipped), for the optimizer to assign when the step is finite."""
    return [(v, x) for vs, xs in zip(variables, values) if xs is not None
            for v, x in zip(vs, xs)]


class ClippingTransform:
    """The clipping rules of :mod:`tf_blocksparse.clipping`, applied in order to each
    replica's local gradient of each variable (every position, stateless ones too).

    Args:
      rules: The rules (``()``: the identity, no state).
      unit_axes: Per variable index, the axes of its AGC units (see
        :mod:`tf_blocksparse.unitwise`); read when the step is traced.
    """

    def __init__(self, rules: Sequence[clipping_lib.ClipRule],
                 unit_axes: Callable[[], Sequence[tuple[int, ...] | None]]):
        self.rules = tuple(rules)
        self._unit_axes = unit_axes

    def init(self, variables: Sequence[Any], new_state: NewState
             ) -> list[list[keras.Variable]]:
        """Per variable, one ``[state_size]`` float32 variable per stateful rule."""
        return [[new_state(v, (rule.state_size,), "float32",
                           f"clip{j}_{type(rule).__name__}_")
                 for j, rule in enumerate(self.rules) if rule.state_size]
                for v in variables]

    def update(self, grads: Sequence[tf.Tensor], state: StateValues,
               params: Sequence[Any], idx: Sequence[int]
               ) -> tuple[list[tf.Tensor], StateValues]:
        if not self.rules:
            return list(grads), [None] * len(grads)
        axes = self._unit_axes()
        num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        grads, new = clipping_lib.apply_rules(
            self.rules, grads, [tf.convert_to_tensor(v) for v in params],
            [s or [] for s in state], num_replicas, [axes[i] for i in idx])
        return grads, [list(n) for n in new]


class MomentumTransform:
    """DGC's momentum correction (a :class:`MomentumCorrection` policy) as a transform:
    ``u = m u + grad`` is what goes into the exchange, and :meth:`mask` takes the blocks a
    replica sent out of its ``u`` after it.

    Args:
      policy: The resolved policy, or ``None`` / an inactive one (the identity, no state).
    """

    def __init__(self, policy: MomentumCorrection | None):
        self.policy = policy

    @property
    def active(self) -> bool:
        """Whether a local momentum is kept (the transform has state)."""
        return self.policy is not None and self.policy.active

    def init(self, variables: Sequence[Any], new_state: NewState
             ) -> list[list[keras.Variable]]:
        """Per variable one velocity of its shape and dtype (none when inactive)."""
        if not self.active:
            return [[] for _ in variables]
        return [[new_state(v, v.shape, v.dtype, "velocity_")] for v in variables]

    def update(self, grads: Sequence[tf.Tensor], state: StateValues,
               params: Sequence[Any], idx: Sequence[int]
               ) -> tuple[list[tf.Tensor], StateValues]:
        del params, idx
        live = [p for p, s in enumerate(state) if s]
        grads, new = list(grads), [None] * len(grads)
        if not live:
            return grads, new
        us = self.policy.accumulate([state[p][0] for p in live], [grads[p] for p in live])
        for p, u in zip(live, us):
            grads[p], new[p] = u, [u]
        return grads, new

    def mask(self, new: StateValues, layouts: Callable[[], Sequence[BlockLayout]],
             sent_ids: Sequence[tf.Tensor | None] | None,
             residuals: Sequence[tf.Tensor | None] | None,
             inner_applies: Sequence[bool]) -> StateValues:
        """The velocities after the exchange: what a replica sent leaves its ``u`` too.

        Args:
          new: :meth:`update`'s new state, per position.
          layouts: Returns per position its block layout (the compressor's).
          sent_ids: Per position the block ids this replica sent (``None``: none known).
          residuals: Per position the residual from before the step (``None``: none).
          inner_applies: Per position, whether the inner optimizer applies the momentum
            now (a dense group of the automatic exchange): its velocity is zeroed.
        """
        live = [p for p, s in enumerate(new) if s]
        if not live:
            return new
        kept = self.policy.mask(
            [new[p][0] for p in live], [layouts()[p] for p in live],
            None if sent_ids is None else [sent_ids[p] for p in live],
            None if residuals is None else [residuals[p] for p in live])
        out: StateValues = [None] * len(new)
        for p, u in zip(live, kept):
            out[p] = [tf.zeros_like(u) if inner_applies[p] else u]
        return out
