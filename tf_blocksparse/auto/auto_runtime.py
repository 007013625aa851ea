"""What ``exchange="auto"`` and ``dense_steps`` add to
:class:`~tf_blocksparse.keras.optimizer.BlockSparseOptimizer`: modes that change in training.

One :class:`AutoExchangeRuntime` per optimizer holds the parts of the step that depend on the
mode of each fusion group: with ``exchange="auto"`` the
:class:`~tf_blocksparse.auto.auto_exchange.ExchangeChooser` (measurements and the mode of
every group), during a dense phase (``dense_steps``) the dense mode for every group, where a
group's momentum lives in each mode, and the state that moves when a group changes mode
(:mod:`~tf_blocksparse.auto.mode_switch`).  The optimizer asks it three things per step:
which variables carry no per-replica state (dense groups flushed at their switch), which
variables' momentum the inner SGD applies (dense groups), and how the fusion groups are
exchanged (adjacent groups of one mode share one set of collectives).

A dense phase is the fixed exchange's (or the chooser's) modes overridden by ``"dense"``
until :meth:`AutoExchangeRuntime.end_dense_phase`: its steps are ``exchange="dense"``'s bit
for bit (no per-replica state, an inner SGD's own momentum), and its end moves the state as
any switch from dense does.  The chooser may re-decide meanwhile; its modes take effect when
the phase ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse.auto import mode_switch
from tf_blocksparse.auto.auto_exchange import ExchangeChooser, can_measure
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.keras import inner_optimizer
from tf_blocksparse.planning.exchange_cost import merge_runs
from tf_blocksparse.planning.exchange_decision import ExchangeDecision

__all__ = ["AutoExchangeRuntime"]


class AutoExchangeRuntime:
    """The automatic exchange's part of one optimizer.

    Args:
      owner: The ``BlockSparseOptimizer`` built with ``exchange="auto"`` or a sparse
        exchange and ``dense_steps`` (its inner optimizer, momentum policy and, at a
        switch, its per-replica state are used).

    Attributes:
      inner_momentum: Local momentum ``m`` over an inner ``SGD`` (not Nesterov, without
        momentum of its own): a dense group keeps its momentum in the inner SGD (the dense
        exchange's math, bit for bit), a sparse group in the per-replica velocities; the
        inner SGD then applies ``m`` to the dense groups' variables only.
      flush_at_switch: A group entering the dense exchange is flushed at the switch (its
        residual applied once, its momentum moved), so dense groups carry no per-replica
        state in the step; otherwise its first dense step sends ``grad + residual``.
      chooser: The :class:`ExchangeChooser` once an owner with ``exchange="auto"`` is
        built, else ``None`` (a fixed exchange: every group in it after the dense phase).
      dense_phase: Whether every group is exchanged densely for now (``dense_steps``).
    """

    def __init__(self, owner: Any):
        inner, momentum = owner.inner_optimizer, owner.momentum_policy
        self._owner = owner
        self.dense_phase = owner.compression.dense_steps > 0
        self._groups: list[list[int]] = []
        self._strategy: Any = None
        self.inner_momentum = bool(
            momentum is not None and momentum.active
            and isinstance(inner, keras.optimizers.SGD) and not inner.nesterov
            and not inner.momentum)
        # local steps exchange progress for the outer optimizer: a group that turns dense
        # sends its residual with its next pseudo-gradient, never through the inner one
        self.flush_at_switch = (owner.sync_every is None and
                                mode_switch.flushes_at_switch(inner, self.inner_momentum))
        self.chooser: ExchangeChooser | None = None
        self._variables: list[Any] = []
        if self.inner_momentum:
            inner_optimizer.momentum_in_dense_groups(inner, momentum.momentum,
                                                     self.in_dense_group)

    def build(self, strategy: Any, variables: Sequence[Any],
              groups: Sequence[Sequence[int]], compressors: Sequence[BlockTopK],
              dtypes: Sequence[Sequence[Any]], costs: Sequence[Any] | None = None) -> None:
        """Keeps the owner's fusion groups (indices into its trainable ``variables``, which a
        switch updates) under ``strategy``; with ``exchange="auto"`` creates the chooser over
        them (``costs``: the groups' byte costs if already computed) and, where collectives
        can be timed (eagerly, cross-replica), takes the build-time decision; the state is
        still empty then, so nothing moves."""
        self._variables = list(variables)
        self._groups = [list(g) for g in groups]
        self._strategy = strategy
        if not self._owner.compression.auto:
            return
        self.chooser = ExchangeChooser(self._owner.exchange, strategy, groups, compressors,
                                       dtypes, costs=costs,
                                       steps_per_exchange=self._owner.steps_per_exchange)
        if can_measure():  # nothing is traced yet: free to choose any modes
            self.chooser.decide(hysteresis=False)
        self.chooser.on_change = self._on_modes_change

    @tf.autograph.experimental.do_not_convert  # decided while tracing, in Python
    def mode_of(self, variable: int) -> str:
        """The mode variable index ``variable`` is exchanged with now."""
        if self.dense_phase:
            return "dense"
        if self.chooser is not None:
            return self.chooser.mode_of(variable)
        return self._owner.exchange

    def _modes(self) -> list[str]:
        """The mode of every group after the dense phase."""
        if self.chooser is not None:
            return list(self.chooser.modes)
        return [self._owner.exchange] * len(self._groups)

    @tf.autograph.experimental.do_not_convert  # decided while tracing, in Python
    def in_dense_group(self, variable: int) -> bool:
        """Whether variable index ``variable`` is in a densely exchanged group now."""
        return self.mode_of(variable) == "dense"

    @tf.autograph.experimental.do_not_convert  # decided while tracing, in Python
    def stateless(self, variable: int) -> bool:
        """Whether variable index ``variable`` is in a dense group flushed at its switch (its
        step reads and writes no residual or velocity)."""
        return self.flush_at_switch and self.in_dense_group(variable)

    @tf.autograph.experimental.do_not_convert  # decided while tracing, in Python
    def exchange_groups(self, groups: Sequence[Sequence[int]], idx: Sequence[int]
                        ) -> tuple[list[list[int]], list[str]]:
        """The step's exchange units: adjacent fusion groups (positions of the step's
        gradients, of variables ``idx``) of one mode merged, with their modes.  Each unit is
        packed in variable order (a unit waits for all its members either way), so a step
        whose groups all have one mode packs exactly as that fixed exchange: a ring
        all-reduce's sums depend on where an element sits in the buffer, and with the same
        layout the training is the fixed exchange's bit for bit."""
        merged, modes = merge_runs([list(g) for g in groups],
                                   [self.mode_of(idx[g[0]]) for g in groups],
                                   lambda a, b: a + b)
        return [sorted(g) for g in merged], modes

    def measure(self, compute_s: float | None) -> ExchangeDecision | None:
        """Measures and re-decides (every worker together, eagerly in cross-replica
        context)."""
        if self.chooser is None:
            raise ValueError("measure_exchange() needs a built optimizer with exchange='auto'")
        if not can_measure():
            raise ValueError("measure_exchange() must be called eagerly in cross-replica "
                             "context (it runs collectives on every worker)")
        return self.chooser.decide(compute_s)

    def end_dense_phase(self) -> bool:
        """Ends the dense phase: every group takes its mode (the fixed exchange, or the
        chooser's) and its state moves (eagerly, every worker together).  Returns whether it
        was on (then the step must be re-traced)."""
        if not self.dense_phase:
            return False
        self.dense_phase = False
        self._move(["dense"] * len(self._groups), self._modes())
        self._owner.modes_changed()
        return True

    def _on_modes_change(self, old: Sequence[str], new: Sequence[str]) -> None:
        """The chooser's modes changed: moves the state, unless the dense phase still holds
        every group dense."""
        if not self.dense_phase:
            self._move(old, new)
        self._owner.modes_changed()

    def _move(self, old: Sequence[str], new: Sequence[str]) -> None:
        """Moves per-group state between its dense and sparse homes (eagerly, every worker
        together; see :mod:`~tf_blocksparse.auto.mode_switch`)."""
        owner, groups, strategy = self._owner, self._groups, self._strategy
        inner = owner.inner_optimizer
        leaving = [i for g, a, b in zip(groups, old, new) if a == "dense" != b for i in g]
        entering = [i for g, a, b in zip(groups, old, new) if a != "dense" == b for i in g]
        if self.inner_momentum and owner.velocities:
            mode_switch.to_velocities(strategy, inner, owner.velocities, leaving)
        if self.flush_at_switch:
            mode_switch.flush_to_weights(strategy, inner, self._variables,
                                         owner.residuals, owner.velocities, entering,
                                         self.inner_momentum)
