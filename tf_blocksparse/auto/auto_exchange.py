"""The automatic exchange of :class:`BlockSparseOptimizer` (``exchange="auto"``).

Per fusion group the optimizer exchanges densely or block-sparsely, as the policy
(:class:`~tf_blocksparse.planning.exchange_cost.AutoExchange`) predicts fastest to accuracy
from what is measured on the running cluster:

1. When the optimizer is built eagerly under a strategy (``model.fit`` builds it so), the
   strategy's all-reduce and all-gather are timed at the policy's probe sizes and every
   group's compression is timed locally; every worker's measurements are averaged (a
   collective), the decision is taken from the averages and replica 0's decision is used by
   all, so every worker traces the same exchange.  The time per step outside the exchange
   is not known yet: the policy's ``compute_prior`` times the measured compression time
   stands in for it.
2. :class:`~tf_blocksparse.auto.auto_callback.AutoExchangeCallback` re-decides after
   ``warmup_steps`` and then every ``remeasure_steps`` steps with the measured step time,
   and has Keras re-trace the train function when the choice changed; pass it to
   ``model.fit`` (``tfbs.fit_callbacks(model)`` adds it,
   :mod:`~tf_blocksparse.keras.fit_loop`).  Error feedback stays exact across a switch: the
   owner's ``on_change`` moves the state (:mod:`~tf_blocksparse.auto.mode_switch`: a group
   that turns dense has its residual applied once and its momentum moved into the inner
   SGD; with other inner optimizers it sends ``grad + residual`` in its first dense step).

Without a strategy (one replica) every group is dense and nothing is measured; a policy of
one candidate (a pinned mode) measures nothing either.  Built
inside a ``tf.function`` (a custom loop), nothing can be measured either: every group uses
the first sparse candidate until ``BlockSparseOptimizer.measure_exchange`` is called in
cross-replica context (then re-trace the step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse.auto import link_probe
from tf_blocksparse.exchange_bytes import group_cost
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.planning.exchange_cost import (
    CANDIDATES,
    AutoExchange,
    ExchangeDecision,
    GroupCost,
    LinkCost,
)

__all__ = ["ExchangeChooser", "can_measure", "compression_seconds", "fallback_mode"]

_LOG = logging.getLogger(__name__)


def can_measure() -> bool:
    """Whether collectives can be timed here: eager, in cross-replica context."""
    return tf.executing_eagerly() and (not tf.distribute.has_strategy()
                                       or tf.distribute.in_cross_replica_context())


def fallback_mode(policy: AutoExchange, replicas: int,
                  groups: Sequence[GroupCost] = ()) -> str:
    """The mode of every group before anything is measured (and for good where there is
    no choice: one replica, one candidate, or ``groups`` that all stay dense,
    :meth:`~tf_blocksparse.planning.exchange_cost.AutoExchange.stays_dense`)."""
    if replicas <= 1 or policy.stays_dense(groups):
        return "dense"
    return next((m for m in policy.candidates if m != "dense"), "dense")


def compression_seconds(comps: Sequence[BlockTopK], dtypes: Sequence[Sequence[Any]]) -> float:
    """Summed seconds of one replica's compression of the groups ``comps`` (timed locally)."""
    return float(sum(link_probe.time_compression(comps, dtypes)))


class ExchangeChooser:
    """The automatic exchange's measurements and choice for one optimizer's fusion groups.

    Args:
      policy: The :class:`AutoExchange` policy.
      strategy: The optimizer's strategy (its collectives are timed).
      groups: Variable indices of every fusion group.
      compressors: Per group, the compressor of its variables.
      dtypes: Per group, its variables' dtypes.
      on_change: Called eagerly with ``(old_modes, new_modes)`` whenever the modes change
        (the owner moves state that lives in a different place per mode).
      costs: Per group, its bytes per mode without compression time
        (:func:`~tf_blocksparse.exchange_bytes.group_cost`) when the caller has them.
      steps_per_exchange: Training steps per exchange (accumulated micro-steps or local
        steps): the policy weighs one exchange against that many steps of compute, so the
        prior compute time before any step is timed is that many steps' worth (a measured
        ``compute_s`` passed to :meth:`decide` is per exchange already).

    Attributes:
      modes: Per group, the mode in use.
      decision: The last :class:`ExchangeDecision` (``None`` before any measurement).
      measure_s: Wall seconds spent in :meth:`decide` so far (measuring, agreeing and
        moving state): time a training clock must count, also when it ran before training
        began (the build-time decision).
    """

    def __init__(self, policy: AutoExchange, strategy: tf.distribute.Strategy,
                 groups: Sequence[Sequence[int]], compressors: Sequence[BlockTopK],
                 dtypes: Sequence[Sequence[Any]],
                 on_change: Callable[[list[str], list[str]], None] | None = None,
                 costs: Sequence[GroupCost] | None = None, steps_per_exchange: int = 1):
        self.policy = policy
        self.steps_per_exchange = steps_per_exchange
        self.on_change = on_change
        self.strategy = strategy
        self.groups = [list(g) for g in groups]
        self.compressors = list(compressors)
        self.dtypes = [list(d) for d in dtypes]
        self._group_of = {i: gi for gi, g in enumerate(self.groups) for i in g}
        # the groups' byte sizes per mode (static), without compression times
        self._untimed = (list(costs) if costs is not None else
                         [group_cost(c, d) for c, d in zip(self.compressors, self.dtypes)])
        self.modes = [fallback_mode(policy, strategy.num_replicas_in_sync, self._untimed)
                      ] * len(self.groups)
        self.decision: ExchangeDecision | None = None
        self._probe_cache: dict = {}  # traced compression probes, per group
        self._compress_s: list[float] | None = None  # agreed, since the last link probes
        self.measure_s = 0.0

    @property
    def has_choice(self) -> bool:
        """Whether :meth:`decide` can choose: several replicas, more than one candidate,
        and some group that does not stay dense for good.  Without a choice the modes stay
        :func:`fallback_mode`'s from the start and nothing needs timing."""
        return not (self.strategy.num_replicas_in_sync <= 1 or self.policy.pinned
                    or self.policy.stays_dense(self._untimed))

    @tf.autograph.experimental.do_not_convert  # decided while tracing, in Python
    def mode_of(self, variable: int) -> str:
        """The mode of the group holding variable index ``variable``."""
        return self.modes[self._group_of[variable]]

    def set_modes(self, modes: Sequence[str], decision: ExchangeDecision | None = None
                  ) -> None:
        """Uses ``modes`` (one per group; takes effect when the step is traced next)."""
        if len(modes) != len(self.groups) or any(m not in CANDIDATES for m in modes):
            raise ValueError(f"`modes` must hold one of {CANDIDATES} per group "
                             f"({len(self.groups)}), got {list(modes)!r}")
        old, self.modes, self.decision = self.modes, list(modes), decision
        if self.on_change is not None and old != self.modes:
            self.on_change(old, self.modes)

    def decide(self, compute_s: float | None = None, remeasure: bool = True,
               hysteresis: bool = True, switch_s: float = 0.0,
               steps_left: float | None = None) -> ExchangeDecision | None:
        """Measures, decides and sets :attr:`modes`; every worker must call it together
        (collectives), eagerly in cross-replica context.

        Args:
          compute_s: This worker's measured seconds outside the exchange per exchange (per
            step, or per window of ``steps_per_exchange`` steps), averaged over the workers
            here; ``None``: not measured yet, ``steps_per_exchange`` times the policy's
            :meth:`~AutoExchange.prior_compute_s` is used.
          remeasure: Time the collectives and the compression again; otherwise reuse the
            last decision's measurements (only ``compute_s`` is new).
          hysteresis: Keep the current modes unless the new ones are predicted faster by
            the policy's ``hysteresis``.
          switch_s: What a change of modes costs once (seconds: the step's re-trace).
          steps_left: Steps still to train; with it, the current modes are kept unless the
            new ones save more than ``switch_s`` over them (``None``: not weighed).

        Returns:
          The decision; ``None``, with nothing measured, where there is no choice: with a
          single replica (every group dense), a policy of one candidate (every group in
          it) or one under which every group stays dense
          (:meth:`~tf_blocksparse.planning.exchange_cost.AutoExchange.stays_dense`).
        """
        start = time.perf_counter()
        try:
            return self._decide(compute_s, remeasure, hysteresis, switch_s, steps_left)
        finally:
            self.measure_s += time.perf_counter() - start

    def _decide(self, compute_s: float | None, remeasure: bool, hysteresis: bool,
                switch_s: float, steps_left: float | None) -> ExchangeDecision | None:
        strategy, policy = self.strategy, self.policy
        if not self.has_choice:
            self.set_modes([fallback_mode(policy, strategy.num_replicas_in_sync,
                                          self._untimed)] * len(self.groups))
            return None
        measured = compute_s is not None
        with strategy.scope():
            if remeasure or self.decision is None:
                link, compute = self._measure_link(compute_s or 0.0)
                self._compress_s = None
            else:
                link = self.decision.link
                compute = link_probe.agree_mean(strategy, [compute_s or 0.0])[0]
            costs = self._costs(link, compute)
            if not measured:  # every worker derives the same prior from the agreed costs
                compute = self.steps_per_exchange * policy.prior_compute_s(costs)
            decision = policy.decide(link, costs, compute, self.modes, hysteresis=hysteresis,
                                     switch_s=switch_s, steps_left=steps_left)
            codes = link_probe.from_first_replica(strategy, [CANDIDATES.index(m)
                                                             for m in decision.modes])
        modes = [CANDIDATES[c] for c in codes]
        if modes != list(decision.modes):  # a near tie decided differently: replica 0 wins
            decision = policy.decision_for(link, costs, compute, modes)
        self.set_modes(modes, decision)
        _LOG.info("auto exchange: %s (predicted step %.1f ms, all dense %.1f ms)",
                  ",".join(modes), 1e3 * decision.step_s, 1e3 * decision.dense_step_s)
        return decision

    def _measure_link(self, compute_s: float) -> tuple[LinkCost, float]:
        """Times the collectives; every worker's figures (and ``compute_s``) averaged."""
        policy, strategy, sizes = self.policy, self.strategy, self._untimed
        # all-reduces up to every group's dense bytes at once, all-gathers up to their ids
        # and values: the largest buffers a decision could put on the link
        probed = link_probe.grown_probes(
            strategy, policy.probe_bytes, policy.probe_repeats, policy.probe_seconds,
            {"sum": sum(g.dense_bytes for g in sizes),
             "gather": sum(g.id_bytes + g.value_bytes for g in sizes)})
        (sum_sizes, sum_s), (gather_sizes, gather_s) = probed["sum"], probed["gather"]
        agreed = link_probe.agree_mean(strategy, [*sum_s, *gather_s, compute_s])
        n = len(sum_sizes)
        link = LinkCost.fit(sum_sizes, agreed[:n], agreed[n:-1], gather_sizes)
        return link, agreed[-1]

    def _costs(self, link: LinkCost, compute_s: float) -> list[GroupCost]:
        """Every group's costs, with its compression timed (every worker's mean) only if a
        sparse mode could win with free compression (and ``compute_s``, a lower bound of the
        compute time: more only favours dense): otherwise it stays 0 (not timed)."""
        free = self._untimed
        if self._compress_s is None:
            if all(m == "dense" for m in self.policy.decide(link, free, compute_s).modes):
                return list(free)  # compression only makes the sparse modes dearer
            local = link_probe.time_compression(self.compressors, self.dtypes,
                                                self.policy.probe_repeats, self._probe_cache)
            self._compress_s = link_probe.agree_mean(self.strategy, local)
        return [dataclasses.replace(g, compress_s=t) for g, t in zip(free, self._compress_s)]
