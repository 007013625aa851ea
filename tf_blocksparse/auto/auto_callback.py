"""``AutoExchangeCallback``: the automatic exchange re-decided with measured step times
during ``model.fit`` (step 2 of :mod:`tf_blocksparse.auto.auto_exchange`), and how far
apart its re-measurements are.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tf_blocksparse.auto import link_probe
from tf_blocksparse.keras.fit_loop import OptimizerCallback
from tf_blocksparse.planning.exchange_cost import AutoExchange
from tf_blocksparse.planning.exchange_decision import ExchangeDecision

__all__ = ["AutoExchangeCallback", "remeasure_gap"]


def remeasure_gap(policy: AutoExchange, strategy: tf.distribute.Strategy,
                  decision: ExchangeDecision | None, spent_s: float | None,
                  steps_per_exchange: int = 1) -> float:
    """Steps until the next re-measurement: ``policy.remeasure_steps``, or more so that
    measuring takes at most ``policy.measure_budget`` of the training time.

    Args:
      policy: The automatic exchange's policy.
      strategy: The strategy whose workers agree on the measuring seconds.
      decision: The decision just taken (``None``: nothing was measured).
      spent_s: This worker's seconds of that decision's measuring; ``None`` where it
        re-measured nothing (the first re-decision reuses the build-time figures).
      steps_per_exchange: Training steps per exchange (accumulated micro-steps or local
        steps): the decision's step time is that of a whole window then.

    Returns:
      The gap in steps (``inf``: never again).  Every worker gets the same one: the
      seconds are averaged over the workers (a collective, so every worker calls this
      together) and the step time is the decision's prediction from agreed figures.
    """
    every = policy.remeasure_steps
    if not every:
        return float("inf")
    if policy.measure_budget is None or spent_s is None or decision is None:
        return every
    with strategy.scope():
        spent = link_probe.agree_mean(strategy, [spent_s])[0]
    window_s = max(decision.step_s, 1e-9)  # per exchange
    return max(every, steps_per_exchange * math.ceil(spent / (policy.measure_budget * window_s)))


class AutoExchangeCallback(OptimizerCallback):
    """Re-decides the automatic exchange with measured step times during ``model.fit``.

    After the policy's ``warmup_steps`` steps the choice is re-taken with the time per step
    outside the exchange (the median step time of the steps since the last decision minus
    their mean exchange time) and the build-time measurements; every ``remeasure_steps``
    steps after that (or further apart, within the policy's ``measure_budget``:
    :func:`remeasure_gap`) the link and compression are measured again too, and a new choice
    must beat the current one by the policy's ``hysteresis``.  Every worker runs callbacks,
    so every worker takes part in the measurements.  When it changed, the train function is
    re-traced.  ``tfbs.fit_callbacks(model, mine)`` adds one when the model's optimizer
    exchanges with ``exchange="auto"`` (the default) and ``mine`` holds none
    (:mod:`~tf_blocksparse.keras.fit_loop`); without one the build-time decision stays for
    the whole run.  Keep a reference to read its :attr:`decisions`.  With any other exchange
    it does nothing.

    Attributes:
      initial: The decision in use when training began (the build-time one), or ``None``.
      decisions: ``(step, decision)`` of every re-decision since.
    """

    def __init__(self) -> None:
        super().__init__()
        self._steps = 0
        self._next = 0
        self._t0 = 0.0
        self._walls: list[float] = []
        self._first_s: float | None = None  # the first step: trace and first run
        self._window_start: tuple[float, float] | None = None
        self.decisions: list[tuple[int, ExchangeDecision]] = []
        self.initial: ExchangeDecision | None = None

    def _opt(self) -> Any:
        """The optimizer while its automatic exchange has a choice to make, else ``None``:
        where every group stays dense for good (or there is one replica or one candidate)
        the callback times nothing and reads no metrics (no collectives)."""
        opt = self.block_sparse
        chooser = None if opt is None else opt.exchange_chooser
        return opt if chooser is not None and chooser.has_choice else None

    @staticmethod
    def _totals(opt: Any) -> tuple[float, float]:
        """Summed exchange seconds and steps so far (a collective under multi-worker)."""
        return opt.block_sparse_metrics()["exchange_s_total"], float(opt.iterations.numpy())

    def train_begin(self, opt: Any) -> None:
        if opt.exchange_chooser is not None:
            self._next = opt.exchange.warmup_steps
            self._window_start = None
            if self.initial is None:
                self.initial = opt.exchange_decision

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        opt = self._opt()
        if opt is None:
            return
        self._walls.append(time.perf_counter() - self._t0)
        self._steps += 1
        if self._window_start is None:  # the first step traces: leave it out
            if self._first_s is None:
                self._first_s = self._walls[-1]
            self._window_start = self._totals(opt)
            self._walls = []
            return
        if self._steps < self._next or not self._walls:
            return
        total, steps = self._totals(opt)
        exchange_s = (total - self._window_start[0]) / max(1.0, steps - self._window_start[1])
        step_s = float(np.median(self._walls))
        compute_s = max(0.0, step_s - exchange_s)
        every = opt.steps_per_exchange
        if every > 1:  # per exchange: `every` (micro- or local) steps, one of which exchanges
            compute_s = every * float(np.percentile(self._walls, 25))
        chooser = opt.exchange_chooser
        before = list(chooser.modes)
        first = not self.decisions  # the build-time choice knew no compute time: provisional
        switch_s = max(0.0, (self._first_s or 0.0) - step_s)  # a re-trace costs about that
        params = self.params or {}
        epochs, per_epoch = params.get("epochs"), params.get("steps")
        steps_left = (max(0, epochs * per_epoch - self._steps) // every
                      if epochs and per_epoch else None)  # exchanges left
        spent = chooser.measure_s
        decision = chooser.decide(compute_s, remeasure=not first, hysteresis=not first,
                                  switch_s=switch_s, steps_left=steps_left)
        if decision is not None:
            self.decisions.append((self._steps, decision))
            if list(decision.modes) != before:
                self.model.make_train_function(force=True)
        self._next = self._steps + remeasure_gap(
            opt.exchange, chooser.strategy, decision,
            None if first else chooser.measure_s - spent, steps_per_exchange=every)
        self._window_start = self._totals(opt)
        self._walls = []

