"""The state variables ``BlockSparseOptimizer`` creates when it is built.

:func:`create_state` creates them all, in the order the optimizer's variable list, its
checkpoints and its ``model.keras`` files keep: the residuals (a sparse exchange), the local
momentum's velocities, the clipping rules' state, the statistics row, the local steps'
anchors and outer-update norm, the accumulators, and the window counter of local steps or
accumulation.  The per-replica ones are on-read variables summed over replicas (see
:mod:`~tf_blocksparse.keras.replica_state` for how they are saved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.keras.step_metrics import StepMetrics

__all__ = ["WrapperState", "create_state", "per_replica_variable"]


@dataclasses.dataclass(frozen=True)
class WrapperState:
    """The variables of one built optimizer (lists per trainable variable).

    Attributes:
      residuals: Error-feedback residuals (empty for ``exchange="dense"``).
      velocities: Local momentum of ``momentum_correction`` (else empty).
      clip_states: Per variable, the state of each stateful clipping rule.
      stats: The statistics row (:class:`~tf_blocksparse.keras.step_metrics.StepMetrics`).
      anchors: The local steps' last synchronised weights (``None`` without local steps).
      outer_norm: The local steps' norm of the last outer update (else ``None``).
      accumulators: The accumulated gradients of gradient accumulation (else empty).
      window: The steps of the current window of local steps or accumulation (else
        ``None``).
    """

    residuals: list[keras.Variable]
    velocities: list[keras.Variable]
    clip_states: list[list[keras.Variable]]
    stats: keras.Variable
    anchors: list[keras.Variable] | None
    outer_norm: keras.Variable | None
    accumulators: list[keras.Variable]
    window: keras.Variable | None


def per_replica_variable(strategy: tf.distribute.Strategy,
                         track: Callable[[keras.Variable], None], v: Any,
                         shape: tuple[int, ...], dtype: str, prefix: str) -> keras.Variable:
    """A zero-initialised per-replica (on-read, sum) state variable next to ``v``, named
    ``prefix`` + ``v``'s path, given to ``track`` (the optimizer's variable list)."""
    with strategy.extended.colocate_vars_with(
            v.value if isinstance(v, keras.Variable) else v):
        s = keras.Variable(
            initializer=keras.initializers.Zeros(), shape=shape, dtype=dtype,
            trainable=False, synchronization="on_read", aggregation="sum",
            name=prefix + (getattr(v, "path", None) or v.name).replace("/", "_"))
    track(s)
    return s


def create_state(var_list: Sequence[Any], *, residuals: bool, momentum: Any, clip: Any,
                 local: Any, accumulation: Any,
                 new_state: Callable[..., keras.Variable],
                 add_variable: Callable[..., keras.Variable],
                 add_variable_from_reference: Callable[..., keras.Variable]) -> WrapperState:
    """Creates the optimizer's state over ``var_list``.

    Args:
      var_list: The trainable variables.
      residuals: Whether the exchange keeps residuals (every exchange but ``"dense"``).
      momentum: The :class:`~tf_blocksparse.keras.transforms.MomentumTransform`.
      clip: The :class:`~tf_blocksparse.keras.transforms.ClippingTransform`.
      local: The :class:`~tf_blocksparse.keras.local_steps.LocalSteps`, or ``None``.
      accumulation: The
        :class:`~tf_blocksparse.keras.accumulation.GradientAccumulation`, or ``None``.
      new_state: Creates a per-replica variable, as :func:`per_replica_variable` bound to
        the optimizer.
      add_variable: The optimizer's ``add_variable``.
      add_variable_from_reference: The optimizer's ``add_variable_from_reference``.

    Returns:
      The variables, created in the order of the optimizer's variable list.
    """
    res = [new_state(v, v.shape, v.dtype, "residual_") for v in var_list] if residuals else []
    velocities = [u for us in momentum.init(var_list, new_state) for u in us]
    clip_states = clip.init(var_list, new_state)
    stats = StepMetrics.create_stats()
    anchors = outer_norm = window = None
    if local is not None:
        anchors, outer_norm = local.build(var_list, add_variable_from_reference)
    accumulators = [] if accumulation is None else accumulation.build(var_list, new_state)
    if local is not None or accumulation is not None:
        window = add_variable(shape=(), initializer="zeros", dtype="int64",
                              aggregation="only_first_replica",
                              name="local_steps" if local is not None else "accumulated_steps")
    return WrapperState(res, velocities, clip_states, stats, anchors, outer_norm, accumulators,
                        window)
