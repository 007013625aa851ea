"""One exchange of a replica's gradients, the step ``BlockSparseOptimizer`` runs per exchange.

:class:`ExchangeStep` is the sequence every exchange goes through, on every replica, with the
wrapper's transforms and state::

    g = clip(g)                                   # ClippingTransform (per-replica state)
    u = m u + g                                   # MomentumTransform (momentum correction)
    acc = u + residual; select; exchange          # per fusion bucket, in its mode
    u = mask(u, sent)                             # what a replica sent leaves its velocity
    commit state only if the step is finite on every replica
    optimizer.apply(exchanged update)             # the inner optimizer (or the outer one)

The per-step wrapper calls it once per step; local steps call it once per window with the
pseudo-gradient and the outer optimizer, gradient accumulation once per window with the
window's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.keras import optimizer_step as step
from tf_blocksparse.keras.exchange_schedule import ExchangeSchedule
from tf_blocksparse.keras.optimizer_state import WrapperState
from tf_blocksparse.keras.transforms import (
    ClippingTransform,
    MomentumTransform,
    read_state,
    state_commits,
)
from tf_blocksparse.timing import graph_clock

__all__ = ["ExchangeStep"]


class ExchangeStep:
    """The exchange of one optimizer (a component it owns, bound to its state at build).

    Args:
      clip: The clipping rules as a transform.
      momentum: The momentum correction as a transform.
      schedule: The owner's :class:`~tf_blocksparse.keras.exchange_schedule.ExchangeSchedule`
        (the fusion buckets and their modes, and the changing exchange's runtime).
      compressor: The owner's compressor over a list of variable indices.
      inner: The optimizer that applies the exchanged update by default.
      nonfinite: ``"skip"`` or ``"apply"``.
      metric: The block score (``"l1"`` or ``"l2"``).
    """

    def __init__(self, clip: ClippingTransform, momentum: MomentumTransform,
                 schedule: ExchangeSchedule,
                 compressor: Callable[[Sequence[int]], BlockTopK],
                 inner: keras.optimizers.Optimizer, nonfinite: str, metric: str):
        self._clip, self._momentum, self._schedule = clip, momentum, schedule
        self._compressor, self._inner = compressor, inner
        self._nonfinite, self._metric = nonfinite, metric
        self.state: WrapperState | None = None

    def bind(self, state: WrapperState) -> None:
        """Takes the owner's state variables (created at its build)."""
        self.state = state

    def __call__(self, grads: Sequence[tf.Tensor], tvs: Sequence[Any], idx: Sequence[int],
                 optimizer: keras.optimizers.Optimizer | None = None,
                 counted: bool = True) -> None:
        """Exchanges the replica's ``grads`` and applies the result.

        Args:
          grads: The replica's dense gradients, shaped as ``tvs``.
          tvs: The variables they update (a local step's anchors for an outer update).
          idx: The variables' indices in the owner's variable list.
          optimizer: What applies the exchanged update (default: the inner optimizer).
          counted: Whether the step's figures go into the statistics row's means.
        """
        state = self.state
        ctx = tf.distribute.get_replica_context()
        timed = ctx.num_replicas_in_sync > 1  # one replica: no exchange (and maybe XLA)
        start = graph_clock(grads) if timed else None
        auto = self._schedule.auto
        # positions with per-replica state (all but dense groups flushed at their switch)
        live = [not (auto and auto.stateless(i)) for i in idx]
        clip_vars = [state.clip_states[i] for i in idx]
        velocities = [[state.velocities[i]] if state.velocities else [] for i in idx]
        # 1. clipping, 2. momentum correction: u = m u + g is what gets exchanged
        grads, clip_new = self._clip.update(grads, read_state(clip_vars, [True] * len(idx)),
                                            tvs, idx)
        grads, velocity_new = self._momentum.update(grads, read_state(velocities, live),
                                                    tvs, idx)
        # 3. error feedback and the exchange, per bucket
        residuals = [state.residuals[i] for i in idx] if state.residuals else []
        held = None
        if residuals and any(live):
            held = [tf.convert_to_tensor(r.value) if p else None
                    for p, r in zip(live, residuals)]
        groups, modes = self._schedule.exchange_groups(grads, idx)
        result = step.run_grouped_exchange(
            modes, ctx=ctx, make_comp=lambda group: self._compressor([idx[i] for i in group]),
            grads=grads, state=held, groups=groups, metric=self._metric)
        # 4. factor masking: what a replica sent leaves its velocity too (dense groups'
        # momentum is the inner SGD's there)
        velocity_new = self._momentum.mask(
            velocity_new, lambda: self._compressor(idx).layouts, result.sent_ids, held,
            [bool(auto and auto.inner_momentum and auto.in_dense_group(i)) for i in idx])
        # 5. the state is committed only if the step is finite everywhere
        commits = state_commits(clip_vars, clip_new)
        if held is not None and result.residuals is not None:
            commits += [(r, new) for r, new in zip(residuals, result.residuals)
                        if new is not None]
        commits += state_commits(velocities, velocity_new)
        if commits:
            step.when_finite(self._nonfinite, result.finite,
                             lambda: tf.group([v.value.assign(s) for v, s in commits]))
        # 6. the inner (or outer) optimizer applies the exchanged update
        step.apply_inner(optimizer or self._inner, self._nonfinite, result.updates, tvs,
                         result.finite)
        seconds = graph_clock([tf.convert_to_tensor(tvs[-1])]) - start if timed else 0.0
        step.record_stats(state.stats, result, seconds, counted)
