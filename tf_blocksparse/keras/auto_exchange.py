"""The automatic exchange of :class:`BlockSparseOptimizer` (``exchange="auto"``).

Per fusion group the optimizer exchanges densely or block-sparsely, as the policy
(:class:`~tf_blocksparse.planning.exchange_cost.AutoExchange`) predicts fastest to accuracy
from what is measured on the running cluster:

1. When the optimizer is built eagerly under a strategy (``model.fit`` builds it so), the
   strategy's all-reduce and all-gather are timed at the policy's probe sizes and every
   group's compression is timed locally; every worker's measurements are averaged (a
   collective), the decision is taken from the averages and replica 0's decision is used by
   all, so every worker traces the same exchange.  The time per step outside the exchange
   is not known yet (taken as 0).
2. :class:`AutoExchangeCallback` re-decides after ``warmup_steps`` and then every
   ``remeasure_steps`` steps with the measured step time, and has Keras re-trace the train
   function when the choice changed.  Error feedback stays exact across a switch: a group
   that turns dense sends ``grad + residual`` and zeroes its residual.

Without a strategy (one replica) every group is dense and nothing is measured.  Built
inside a ``tf.function`` (a custom loop), nothing can be measured either: every group uses
the first sparse candidate until :meth:`BlockSparseOptimizer.measure_exchange` is called in
cross-replica context (then re-trace the step).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_blocksparse.distribute import link_probe
from tf_blocksparse.exchange import group_cost
from tf_blocksparse.planning.exchange_cost import (
    CANDIDATES,
    AutoExchange,
    ExchangeDecision,
    LinkCost,
)

__all__ = ["AutoExchangeCallback", "can_measure", "compression_seconds", "fallback_modes",
           "measure_and_decide"]

_LOG = logging.getLogger(__name__)


def group_members(opt: Any) -> list[list[int]]:
    """Variable indices of every fusion group (one group without a fusion buffer)."""
    plan = opt.fusion_plan
    if plan is None:
        return [list(range(len(opt._trainable_variables)))]
    return [list(g.members) for g in plan.groups]


def can_measure() -> bool:
    """Whether collectives can be timed here: eager, in cross-replica context."""
    return tf.executing_eagerly() and (not tf.distribute.has_strategy()
                                       or tf.distribute.in_cross_replica_context())


def fallback_modes(policy: AutoExchange, replicas: int) -> str:
    """The mode of every group before anything is measured."""
    if replicas <= 1:
        return "dense"
    return next((m for m in policy.candidates if m != "dense"), "dense")


def compression_seconds(opt: Any) -> float:
    """Seconds of one replica's compression per step with the exchange in use: the groups
    exchanged sparsely, timed locally (no collective; 0 for a dense exchange)."""
    groups = group_members(opt)
    modes = opt._group_modes(groups) or [opt.exchange] * len(groups)
    tvs = opt._trainable_variables
    sparse = [g for g, m in zip(groups, modes) if m != "dense"]
    return sum(link_probe.time_compression(
        [opt._compressor(g) for g in sparse], [[tvs[i].dtype for i in g] for g in sparse]))


def measure_and_decide(opt: Any, compute_s: float = 0.0) -> ExchangeDecision | None:
    """Measures link and compression, decides, and sets the optimizer's per-variable modes.

    Must run on every worker at the same point (it runs collectives).  Returns the
    decision (``None`` with a single replica: every group dense, nothing measured).
    """
    policy: AutoExchange = opt.exchange
    strategy = opt._distribution_strategy  # the optimizer's own (also outside its scope)
    groups = group_members(opt)
    tvs = opt._trainable_variables
    replicas = strategy.num_replicas_in_sync
    if replicas <= 1:
        opt._set_modes(groups, ["dense"] * len(groups), None)
        return None
    comps = [opt._compressor(g) for g in groups]
    dtypes = [[tvs[i].dtype for i in g] for g in groups]
    sizes = list(policy.probe_bytes)
    with strategy.scope():
        sum_s, gather_s = link_probe.time_collectives(strategy, sizes, policy.probe_repeats)
        compress_s = link_probe.time_compression(comps, dtypes, policy.probe_repeats)
        agreed = link_probe.agree_mean(strategy, [*sum_s, *gather_s, *compress_s,
                                                  compute_s])
    n = len(sizes)
    link = LinkCost.fit(sizes, agreed[:n], agreed[n:2 * n])
    costs = [group_cost(c, d, t) for c, d, t in zip(comps, dtypes, agreed[2 * n:-1])]
    current = opt._group_modes(groups)
    decision = policy.decide(link, costs, agreed[-1], current)
    with strategy.scope():
        codes = link_probe.from_first_replica(strategy, [CANDIDATES.index(m)
                                                         for m in decision.modes])
    modes = [CANDIDATES[c] for c in codes]
    if modes != list(decision.modes):  # a near tie decided differently: replica 0 wins
        decision = policy.decide(link, costs, agreed[-1], modes)
    opt._set_modes(groups, modes, decision)
    _LOG.info("auto exchange: %s (predicted step %.1f ms, all dense %.1f ms)",
              ",".join(modes), 1e3 * decision.step_s, 1e3 * decision.dense_step_s)
    return decision


class AutoExchangeCallback(keras.callbacks.Callback):
    """Re-decides the automatic exchange with measured step times during ``model.fit``.

    After the policy's ``warmup_steps`` steps and then every ``remeasure_steps`` steps, the
    link and compression are measured again, the time per step outside the exchange is
    taken as the median step time of the steps since the last decision minus their mean
    exchange time, and the choice is re-taken (every worker runs callbacks, so every
    worker takes part in the measurements).  When it changed, the train function is
    re-traced.  Add it to ``callbacks=`` with an optimizer built with ``exchange="auto"``;
    with any other exchange it does nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._steps = 0
        self._next = 0
        self._t0 = 0.0
        self._walls: list[float] = []
        self._window_start: tuple[float, float] | None = None
        self.decisions: list[tuple[int, ExchangeDecision]] = []

    def _opt(self) -> Any:
        from tf_blocksparse.keras.callbacks import find_block_sparse  # imports the optimizer

        opt = find_block_sparse(getattr(self.model, "optimizer", None))
        return opt if opt is not None and opt.built and opt.compression.auto else None

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self._opt()
        if opt is not None:
            self._next = opt.exchange.warmup_steps
            self._window_start = None

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        opt = self._opt()
        if opt is None:
            return
        self._walls.append(time.perf_counter() - self._t0)
        self._steps += 1
        if self._window_start is None:  # the first step traces: leave it out
            self._window_start = opt._exchange_totals()
            self._walls = []
            return
        if self._steps < self._next or not self._walls:
            return
        total, steps = opt._exchange_totals()
        exchange_s = (total - self._window_start[0]) / max(1.0, steps - self._window_start[1])
        compute_s = max(0.0, float(np.median(self._walls)) - exchange_s)
        before = opt._group_modes(group_members(opt))
        decision = measure_and_decide(opt, compute_s)
        if decision is not None:
            self.decisions.append((self._steps, decision))
            if list(decision.modes) != before:
                self.model.make_train_function(force=True)
        every = opt.exchange.remeasure_steps
        self._next = self._steps + every if every else float("inf")
        self._window_start = opt._exchange_totals()
        self._walls = []
