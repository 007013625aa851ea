"""The figures ``BlockSparseOptimizer`` reports about its exchange.

Each replica writes one row of statistics per step (``blocksparse_stats``, an on-read
variable averaged over replicas; see :mod:`~tf_blocksparse.keras.optimizer_step` for its
layout).  :class:`StepMetrics` (a component the optimizer owns) creates it and turns it,
with the local steps' and the automatic exchange's figures, into the dictionary of
:meth:`StepMetrics.figures`, which ``BlockSparseMetrics`` logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from tf_blocksparse.keras import optimizer_step as step

__all__ = ["StepMetrics"]


class StepMetrics:
    """The statistics of one optimizer.

    Args:
      owner: The ``BlockSparseOptimizer`` (its ``built``, ``sync_every``, outer optimizer
        and ``exchange_decision`` are read).
      stats: Returns the owner's statistics row (once built).
      outer_norm: Returns the owner's norm of the last outer update (with ``sync_every``).
    """

    def __init__(self, owner: Any, stats: Callable[[], keras.Variable],
                 outer_norm: Callable[[], keras.Variable]):
        self._owner = owner
        self._stats = stats
        self._outer_norm = outer_norm

    @staticmethod
    def create_stats() -> keras.Variable:
        """A new per-replica statistics row (on read: the mean over replicas)."""
        return keras.Variable(
            initializer=keras.initializers.Zeros(), shape=(step.STATS_SIZE,), dtype="float32",
            trainable=False, synchronization="on_read", aggregation="mean",
            name="blocksparse_stats")

    def figures(self, mean: bool = False) -> dict[str, float]:
        """Last step's figures, averaged over replicas (a collective under multi-worker).

        Args:
          mean: Instead of the last step's, the per-step figures (bytes, ``blocks_kept``,
            ``residual_norm``, ``exchange_s``) as their means over the finite steps since
            :meth:`reset_means` (``BlockSparseMetrics`` resets at each epoch).

        Returns:
          ``payload_bytes`` and ``dense_bytes`` handed to collectives per replica,
          ``blocks_kept``, ``residual_norm`` (in the selection metric), ``skipped_steps``
          (the total since the optimizer was built in this process), ``exchange_s`` (the
          wrapper's time in the last step: clipping, compression, collectives, inner apply)
          and its running total ``exchange_s_total``; with ``exchange="auto"`` also the
          decision's figures (``auto_*``, see
          :meth:`~tf_blocksparse.planning.exchange_cost.ExchangeDecision.summary`); with
          ``sync_every`` also ``syncs`` (exchanges so far) and ``outer_update_norm`` (the L2
          norm of the last exchange's move of the weights).  With ``mean``, the bytes are
          per training step, amortised over the window.  Empty before the build.
        """
        owner = self._owner
        if not owner.built:
            return {}
        out = step.stat_figures(self._stats().numpy(), mean)
        if owner.sync_every is not None:
            out["syncs"] = float(owner.outer_optimizer.iterations.numpy())
            out["outer_update_norm"] = float(self._outer_norm().numpy())
        if owner.exchange_decision is not None:
            out.update(owner.exchange_decision.summary())
        return out

    def reset_means(self) -> None:
        """Starts the means of ``figures(mean=True)`` afresh (a local write on each worker,
        no collective)."""
        if self._owner.built:
            step.reset_sums(self._stats())
