"""Automatic exchange: per fusion group, dense all-reduce or a block-sparse exchange.

Pure Python (no TensorFlow).  The inputs are measured on the running cluster elsewhere
(:mod:`tf_blocksparse.auto.link_probe`: the collectives are timed, the compression is
timed per group) and passed in; this module only predicts and decides.  The step cost of
each mode is the project's one cost model, :mod:`~tf_blocksparse.planning.link_cost` (its
names are re-exported here): a :class:`LinkCost` fitted to the measured collectives prices
every fusion group's :class:`GroupCost` per mode (:func:`mode_seconds`).

Error feedback delays what is not sent, so a sparse exchange needs more steps to reach the
same accuracy.  The decision therefore minimises the *time to accuracy*, not the step time::

    (compute + sum_g cost_g) * (1 + sum_g convergence_cost[mode_g] * f_g)

summed over the sparse groups, with ``f`` a group's share of the gradient bytes (its
recurrent layers' bytes counted ``recurrent_cost`` times, by default infinitely often: their
delay costs far more steps) and
``convergence_cost`` the extra steps a fully sparse run in the group's mode needs.  The
modes differ: with ``allgather`` every replica's own top blocks arrive (up to ``N k`` blocks
per step), with ``shared`` only the ``k`` blocks of the summed scores.  Our 4-worker
time-to-accuracy runs at density 0.05 needed 1.38x (ResNet-20) to 1.63x (vgg_fc) the dense
steps with ``allgather`` and 1.75x to 1.88x with ``shared``: the defaults are 0.5 and 0.8.
The minimisation gives each group the sparse mode that lowers the objective most on its own,
ranks groups by step seconds saved per weighted byte delayed and takes the best prefix of
that order, or one sparse mode everywhere if that is better, so the result is never
predicted worse than all-dense or all-sparse.  Adjacent groups that get the same mode are
exchanged together (one set of collectives, :func:`exchange_seconds`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tf_blocksparse.planning.exchange_decision import ExchangeDecision
from tf_blocksparse.planning.link_cost import (
    EXCHANGES,
    SPARSE_EXCHANGES,
    GroupCost,
    LinkCost,
    count,
    exchange_seconds,
    merge_runs,
    mode_seconds,
    number,
)

__all__ = ["CANDIDATES", "AutoExchange", "ExchangeDecision", "GroupCost", "LinkCost",
           "exchange_seconds", "merge_runs", "mode_seconds"]

#: The modes an automatic exchange may choose from: :data:`EXCHANGES`, dense first (the
#: order of a default policy's ``candidates`` in a saved config).
CANDIDATES = (EXCHANGES[-1], *SPARSE_EXCHANGES)
#: Default extra steps of a fully sparse exchange per mode (module docstring).
_CONVERGENCE_COST = {"allgather": 0.5, "shared": 0.8}


@dataclasses.dataclass(frozen=True)
class AutoExchange:
    """The policy of ``exchange="auto"``: measure, predict, choose per fusion group.

    Args:
      candidates: Modes to choose from (a subset of :data:`CANDIDATES`); with one, every
        group uses it and nothing is measured (a pinned mode).
      convergence_cost: Extra steps, as a fraction, that a fully sparse exchange needs to
        reach dense's accuracy (>= 0; 0 decides on step time alone): one number for both
        sparse modes, or a mapping ``{"allgather": a, "shared": s}`` (a mode left out
        keeps its default, 0.5 and 0.8).  Kept as ``((mode, cost), ...)`` (the policy stays
        hashable); read it per mode with :meth:`convergence_cost_of`.
      probe_bytes: Buffer sizes (bytes, two or more distinct) the collectives are timed
        with.
      probe_repeats: Timed runs of every probe, collective or compression; the median is
        taken (>= 1).
      probe_seconds: Beyond ``probe_bytes``, probes grow 4x at a time until one collective
        takes this long (or the size reaches all the bytes the groups could send at once), so
        the per-byte cost is timed where the link's bandwidth shows, not its burst allowance
        and buffers (>= 0; 0: ``probe_bytes`` only).
      warmup_steps: Steps after which the first decision with a measured compute time is
        taken (by ``AutoExchangeCallback``).
      remeasure_steps: Steps between later re-measurements (0: never): the least gap.
      measure_budget: The largest fraction of the training time that re-measuring may
        take (in (0, 1]; ``None``: no limit): after each re-measurement the next one waits
        ``max(remeasure_steps, measuring seconds / (measure_budget * predicted step
        seconds))`` steps, from figures every worker agrees on.  On a fast link, where a
        step takes tens of milliseconds and a re-measurement a few tenths of a second, the
        default (1%) spaces them further than ``remeasure_steps``.
      hysteresis: A new decision replaces the current one only if predicted at least this
        fraction faster (in [0, 1)), so noise does not flip it back and forth.
      compute_prior: Before any step has been timed (the build-time decision), the time per
        step outside the exchange is taken as this many times the measured compression
        time of all groups (>= 0; 0: no time at all, the literal reading, which favours the
        modes with the fastest exchange over those that converge in fewer steps).  The
        compression time stands for the model's size; the factor is calibrated: in our
        4-worker runs the time outside the exchange was 30-45x the compression time of
        ResNet-20 (a conv reuses each weight at every position) and 6-9x that of the
        FC-heavy ``vgg_fc``, and every build-time choice there matched the measured one
        for factors between about 23 and 40.  A build-time choice that the measured time
        overturns costs a re-trace.  ``AutoExchangeCallback``
        replaces it with the measured time after ``warmup_steps``.
      recurrent_cost: How many times recurrent layers' delayed bytes count in the
        convergence cost (>= 0; 1: like any other layer's), or ``None`` (the default): a
        sparse mode never delays them, so a group holding recurrent layers' compressed
        variables stays dense (if ``"dense"`` is a candidate).  Measured (4 replicas,
        20 epochs, the converged target): ``gru_nmt`` with k=1 everywhere needs 2.26x
        dense's epochs, with the GRU layers sent whole dense's epochs, and with k=1 on the
        GRU layers alone it does not get there; ``lstm_nmt`` with k=1 ends at 0.48 token
        accuracy against dense's 1.00, so no finite cost prices it.  For ``gru_nmt`` alone
        3.0 would fit (its GRU layers hold 77% of the bytes: 1.26 / (0.5 * 0.77) = 3.3).

    Raises:
      ValueError: A bad value, naming the argument.
    """

    candidates: tuple[str, ...] = CANDIDATES
    convergence_cost: Any = tuple(_CONVERGENCE_COST.items())
    probe_bytes: tuple[int, ...] = (16 * 1024, 256 * 1024)
    probe_repeats: int = 3
    probe_seconds: float = 0.03
    warmup_steps: int = 20
    remeasure_steps: int = 500
    measure_budget: float | None = 0.01
    hysteresis: float = 0.05
    compute_prior: float = 30.0
    recurrent_cost: float | None = None

    def __post_init__(self) -> None:
        cands = self.candidates
        if isinstance(cands, str) or not isinstance(cands, Sequence) or not cands or \
                any(c not in CANDIDATES for c in cands) or len(set(cands)) != len(cands):
            raise ValueError(f"`candidates` must be distinct modes of {CANDIDATES}, "
                             f"got {cands!r}")
        object.__setattr__(self, "candidates", tuple(cands))
        cost = self.convergence_cost
        if isinstance(cost, tuple) and all(isinstance(p, tuple) for p in cost):
            cost = dict(cost)
        if isinstance(cost, Mapping):
            unknown = set(cost) - set(SPARSE_EXCHANGES)
            if unknown:
                raise ValueError(f"`convergence_cost` takes the sparse modes {SPARSE_EXCHANGES}, "
                                 f"got {sorted(unknown)}")
            pairs = tuple((m, number(f"convergence_cost[{m!r}]",
                                      cost.get(m, _CONVERGENCE_COST[m]))) for m in SPARSE_EXCHANGES)
        else:
            value = number("convergence_cost", cost)
            pairs = tuple((m, value) for m in SPARSE_EXCHANGES)
        # stored as ((mode, cost), ...): the policy stays hashable
        object.__setattr__(self, "convergence_cost", pairs)
        sizes = self.probe_bytes
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or \
                len(set(sizes)) < 2 or any(isinstance(s, bool) or not isinstance(s, int)
                                           or s < 4 for s in sizes):
            raise ValueError(f"`probe_bytes` must hold two or more distinct ints >= 4, "
                             f"got {sizes!r}")
        object.__setattr__(self, "probe_bytes", tuple(sorted(sizes)))
        count("probe_repeats", self.probe_repeats, 1)
        number("probe_seconds", self.probe_seconds)
        count("warmup_steps", self.warmup_steps, 1)
        count("remeasure_steps", self.remeasure_steps, 0)
        if self.measure_budget is not None and \
                not 0 < number("measure_budget", self.measure_budget) <= 1:
            raise ValueError(f"`measure_budget` must be in (0, 1] or None, "
                             f"got {self.measure_budget!r}")
        if number("hysteresis", self.hysteresis) >= 1:
            raise ValueError(f"`hysteresis` must be in [0, 1), got {self.hysteresis!r}")
        number("compute_prior", self.compute_prior)
        if self.recurrent_cost is not None:
            number("recurrent_cost", self.recurrent_cost)

    def decide(self, link: LinkCost, groups: Sequence[GroupCost], compute_s: float = 0.0,
               current: Sequence[str] | None = None, *, hysteresis: bool = True,
               switch_s: float = 0.0, steps_left: float | None = None) -> ExchangeDecision:
        """The modes that minimise the predicted time to accuracy.

        Args:
          link: Measured collective costs.
          groups: Per fusion group, sizes and compression time.
          compute_s: Measured seconds per step outside the exchange.
          current: The modes in use; kept unless the new choice is predicted faster by
            more than the policy's ``hysteresis`` (if ``hysteresis``) and, when
            ``steps_left`` is known, unless it saves more than ``switch_s`` over them.
          hysteresis: Apply the policy's ``hysteresis`` to ``current``.
          switch_s: Seconds a change of modes costs once (the train step's re-trace).
          steps_left: Steps still to train (``None``: unknown, ``switch_s`` not weighed).
            Switching saves ``steps_left * step(current) * (1 - objective(new) /
            objective(current))`` seconds: the same progress in fewer seconds.
        """
        groups = tuple(groups)
        compute_s = number("compute_s", compute_s)
        switch_s = number("switch_s", switch_s)
        if steps_left is not None:
            steps_left = number("steps_left", steps_left)
        sparse = [m for m in self.candidates if m in SPARSE_EXCHANGES]
        def evaluate(modes: Sequence[str]) -> tuple[float, float]:
            return self._step_and_objective(link, groups, compute_s, modes)

        dense_modes = ["dense"] * len(groups)

        def alone(i: int, mode: str) -> float:  # the objective with only group i in mode
            return evaluate(dense_modes[:i] + [mode] + dense_modes[i + 1:])[1]

        if not sparse:
            best = dense_modes
        else:
            own = [min(sparse, key=lambda m, i=i: (alone(i, m), mode_seconds(link, g, m)))
                   for i, g in enumerate(groups)]
            if "dense" not in self.candidates:
                best = own
            else:
                saved = [mode_seconds(link, g, "dense") - mode_seconds(link, g, m)
                         for g, m in zip(groups, own)]
                order = sorted((i for i in range(len(groups)) if saved[i] > 0),
                               key=lambda i: -saved[i] / max(
                                   1e-12, self.delay_cost(groups[i], own[i])))
                best, modes = list(dense_modes), list(dense_modes)
                for i in order:
                    modes[i] = own[i]
                    if evaluate(modes)[1] < evaluate(best)[1]:
                        best = list(modes)
            for m in sparse:  # one mode everywhere: one set of collectives in all
                if evaluate([m] * len(groups))[1] < evaluate(best)[1]:
                    best = [m] * len(groups)
        if current is not None and len(current) == len(groups) and \
                all(m in CANDIDATES for m in current) and list(current) != best:
            cur_step, cur_objective = evaluate(current)
            new_objective = evaluate(best)[1]
            saved = math.inf if steps_left is None else \
                steps_left * cur_step * (1 - new_objective / max(cur_objective, 1e-12))
            if (hysteresis and new_objective > (1 - self.hysteresis) * cur_objective) or \
                    saved <= switch_s:
                best = list(current)
        return self.decision_for(link, groups, compute_s, best)

    def decision_for(self, link: LinkCost, groups: Sequence[GroupCost], compute_s: float,
                     modes: Sequence[str]) -> ExchangeDecision:
        """The :class:`ExchangeDecision` of the given ``modes`` (one per group): their
        predicted step and objective next to all dense's, nothing chosen.

        Raises:
          ValueError: ``modes`` does not hold one of :data:`CANDIDATES` per group.
        """
        groups = tuple(groups)
        compute_s = number("compute_s", compute_s)
        if len(modes) != len(groups) or any(m not in CANDIDATES for m in modes):
            raise ValueError(f"`modes` must hold one of {CANDIDATES} per group "
                             f"({len(groups)}), got {list(modes)!r}")
        step, objective = self._step_and_objective(link, groups, compute_s, modes)
        dense_step, dense_objective = self._step_and_objective(
            link, groups, compute_s, ["dense"] * len(groups))
        return ExchangeDecision(tuple(modes), link, groups, compute_s, step, dense_step,
                                objective, dense_objective)

    def _step_and_objective(self, link: LinkCost, groups: Sequence[GroupCost],
                            compute_s: float, modes: Sequence[str]) -> tuple[float, float]:
        """Predicted seconds per step of ``modes`` and their time-to-accuracy objective
        (module docstring)."""
        step = compute_s + exchange_seconds(link, groups, modes)
        total = max(1, sum(g.dense_bytes for g in groups))
        delayed = math.fsum(self.delay_cost(g, m) for g, m in zip(groups, modes))
        return step, step * (1 + delayed / total)

    @property
    def pinned(self) -> bool:
        """Whether there is nothing to choose (one candidate): nothing is measured."""
        return len(self.candidates) == 1

    def prior_compute_s(self, groups: Sequence[GroupCost]) -> float:
        """The time per step outside the exchange assumed before any step is timed:
        ``compute_prior`` times the groups' summed compression seconds."""
        return self.compute_prior * math.fsum(g.compress_s for g in groups)

    def stays_dense(self, groups: Sequence[GroupCost]) -> bool:
        """Whether every group stays dense whatever is measured: each delays recurrent
        layers' bytes under ``recurrent_cost=None`` (nothing to measure or decide)."""
        return bool(groups) and all(math.isinf(self.weighted_delay(g)) for g in groups)

    def weighted_delay(self, group: GroupCost) -> float:
        """``group``'s delayed bytes with its recurrent layers' weighted by
        ``recurrent_cost`` (infinite if it is ``None`` and the group delays some, where
        ``"dense"`` is a candidate; with no dense candidate, counted once)."""
        if self.recurrent_cost is None and "dense" not in self.candidates:
            return float(group.delayed_bytes)
        if self.recurrent_cost is None:
            return math.inf if group.recurrent_bytes else float(group.delayed_bytes)
        return group.delayed_bytes + (self.recurrent_cost - 1.0) * group.recurrent_bytes

    def delay_cost(self, group: GroupCost, mode: str) -> float:
        """``group``'s weighted delayed bytes times ``mode``'s convergence cost (0 for
        ``"dense"`` or a cost of 0)."""
        cost = self.convergence_cost_of(mode)
        return cost * self.weighted_delay(group) if cost else 0.0

    def convergence_cost_of(self, mode: str) -> float:
        """The convergence cost of ``mode`` (0 for ``"dense"``)."""
        return 0.0 if mode == "dense" else dict(self.convergence_cost)[mode]

    def get_config(self) -> dict[str, Any]:
        """JSON-friendly constructor arguments."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = dict(v) if f.name == "convergence_cost" else \
                list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AutoExchange:
        """Inverse of :meth:`get_config`; unknown keys are named in the error."""
        unknown = set(config) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"AutoExchange does not take {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
