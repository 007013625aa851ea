"""Gradient accumulation of ``BlockSparseOptimizer`` (``gradient_accumulation_steps = n``).

Each replica adds its gradients of ``n`` micro-steps to its own accumulators (no
communication); on every ``n``-th micro-step the mean of the window's gradients goes through
the optimizer's exchange as one step's would (clipping, error feedback, the exchange, the
inner optimizer).  A window whose mean is not finite on some replica is dropped on every
replica.  ``iterations`` counts micro-steps (the inner optimizer's learning-rate schedule sees
them, as in Keras).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import codec
from tf_blocksparse.keras import optimizer_step as step

__all__ = ["GradientAccumulation"]


class GradientAccumulation:
    """The accumulation of one optimizer (a component it owns).

    Args:
      steps: Micro-steps per exchange (>= 2).
      exchange: The optimizer's exchange, ``exchange(grads, variables, idx)``.
      stats: Returns the optimizer's per-replica statistics row.
      iterations: Returns the inner optimizer's ``iterations`` (counted per micro-step).
    """

    def __init__(self, steps: int, exchange: Callable[..., None],
                 stats: Callable[[], keras.Variable], iterations: Callable[[], Any]):
        self.steps = steps
        self._exchange = exchange
        self._stats = stats
        self._iterations = iterations
        self.accumulators: list[keras.Variable] = []
        self.window: keras.Variable | None = None

    def build(self, var_list: Sequence[Any],
              new_state: Callable[[Any, tuple[int, ...], str, str], keras.Variable]
              ) -> list[keras.Variable]:
        """Creates one per-replica accumulator per variable (returned)."""
        self.accumulators = [new_state(v, v.shape, v.dtype, "accumulated_") for v in var_list]
        return self.accumulators

    def step(self, grads: Sequence[tf.Tensor], tvs: Sequence[Any], idx: Sequence[int]
             ) -> None:
        """One micro-step: accumulate, or exchange the window's mean and clear it."""
        n = self.steps
        accumulators = [self.accumulators[i] for i in idx]
        window = self.window

        def exchange(grads: Sequence[tf.Tensor]) -> None:
            mean = [(tf.convert_to_tensor(a.value) + g) / tf.cast(n, g.dtype)
                    for a, g in zip(accumulators, grads)]
            self._exchange(mean, tvs, idx)
            for a in accumulators:
                a.value.assign(tf.zeros_like(a.value))
            window.assign(tf.zeros_like(window.value))

        def accumulate(grads: Sequence[tf.Tensor]) -> None:
            for a, g in zip(accumulators, grads):
                a.value.assign_add(g)
            window.assign_add(tf.ones_like(window.value))
            iterations = self._iterations()
            iterations.assign_add(tf.ones_like(iterations.value))
            step.record_micro_step(self._stats(), sum(codec.buffer_nbytes(g) for g in grads))

        step.replica_cond(window.value + 1 >= n, exchange, accumulate, (list(grads),))
