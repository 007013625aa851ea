"""Which variables ``BlockSparseOptimizer`` exchanges together, and with which mode.

One :class:`ExchangeSchedule` per optimizer (a component it owns) holds the parts of the
exchange that are decided outside the step's math: the fusion groups (``fusion_buffer_bytes``,
contiguous in backward order, see :mod:`tf_blocksparse.fusion`), the modes that
change in training (``exchange="auto"`` and a dense phase, through
:class:`~tf_blocksparse.auto.auto_runtime.AutoExchangeRuntime`), and the callbacks
``model.fit`` needs for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse.auto import auto_callback, auto_exchange
from tf_blocksparse.auto.auto_runtime import AutoExchangeRuntime
from tf_blocksparse.exchange_bytes import group_cost
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.fusion import FusionPlan
from tf_blocksparse.fusion.forward_order import backward_ranks
from tf_blocksparse.keras import dense_phase, local_steps
from tf_blocksparse.keras import optimizer_step as step
from tf_blocksparse.planning.exchange_cost import GroupCost
from tf_blocksparse.planning.exchange_decision import ExchangeDecision

__all__ = ["ExchangeSchedule"]


class ExchangeSchedule:
    """The fusion groups and exchange modes of one optimizer.

    Args:
      owner: The ``BlockSparseOptimizer`` (its ``compression``, ``exchange`` and
        ``fusion_buffer_bytes`` are read; created once its ``compression``,
        ``momentum_policy`` and ``inner_optimizer`` are set).
      compressor: The owner's compressor over a list of variable indices.

    Attributes:
      auto: The :class:`~tf_blocksparse.auto.auto_runtime.AutoExchangeRuntime` with a
        changing exchange (``exchange="auto"``, or ``dense_steps`` with a sparse one), else
        ``None``.
      backward_ranks: Each variable's rank in backward order, from the owner's ``model``
        (with ``fusion_buffer_bytes``, once built), else ``None``.
    """

    def __init__(self, owner: Any, compressor: Callable[[Sequence[int]], BlockTopK]):
        self._owner = owner
        self._compressor = compressor
        self._variables: list[Any] = []
        compression = owner.compression
        changing = compression.auto or (compression.dense_steps and compression.sparse)
        self.auto = AutoExchangeRuntime(owner) if changing else None
        self.backward_ranks: list[int] | None = None
        self._costs: tuple[tuple[Any, ...], list[GroupCost]] | None = None
        self._groups: tuple[tuple[Any, ...], list[list[int]]] | None = None

    def build(self, var_list: Sequence[Any], model: Any) -> None:
        """Orders the variables for fusion (before the owner's Keras build)."""
        self.backward_ranks = (backward_ranks(model, var_list)
                               if self._owner.fusion_buffer_bytes is not None else None)

    def dense_for_good(self, var_list: Sequence[Any]) -> bool:
        """Whether the automatic exchange sends every fusion group of ``var_list`` densely
        whatever it measures: its policy pins ``"dense"``, or keeps every group dense (each
        delays recurrent layers' bytes,
        :meth:`~tf_blocksparse.planning.exchange_cost.AutoExchange.stays_dense`).  The owner
        then keeps no residuals or velocities, as ``exchange="dense"``: nothing to create,
        trace, back up or save.  Read at build, after :meth:`build`."""
        compression = self._owner.compression
        if not compression.auto or compression.dense_steps:
            return False
        policy = self._owner.exchange
        if policy.pinned:
            return policy.candidates[0] == "dense"
        return policy.stays_dense(self._untimed_costs(var_list, self._groups_of(var_list)))

    def _untimed_costs(self, variables: Sequence[Any], groups: Sequence[Sequence[int]]
                       ) -> list[GroupCost]:
        """Each group's bytes per mode (no compression time), computed once per grouping
        and compression: :meth:`dense_for_good` and the automatic exchange's chooser read
        the same."""
        key = ([list(g) for g in groups], [v.dtype for v in variables],
               self._owner.compression)
        if self._costs is None or self._costs[0] != key:
            self._costs = key, [group_cost(self._compressor(g), [variables[i].dtype for i in g])
                                for g in key[0]]
        return self._costs[1]

    def bind(self, strategy: tf.distribute.Strategy, variables: Sequence[Any]) -> None:
        """Keeps the owner's trainable ``variables`` (after its Keras build) and builds the
        automatic exchange over their fusion groups under ``strategy``."""
        self._variables = list(variables)
        if self.auto is not None:
            groups = self.group_indices()
            self.auto.build(strategy, self._variables, groups,
                            [self._compressor(g) for g in groups], self.group_dtypes(groups),
                            self._untimed_costs(self._variables, groups))

    # -- the step's groups ---------------------------------------------------------------
    def exchange_groups(self, grads: Sequence[tf.Tensor], idx: Sequence[int]
                        ) -> tuple[list[list[int]], Any]:
        """The step's exchange units (positions of ``grads``, of variables ``idx``) and their
        mode(s): the fusion groups in backward order (one group without
        ``fusion_buffer_bytes``); with a changing exchange, adjacent groups of one mode
        share one set of collectives."""
        buffer = self._owner.fusion_buffer_bytes
        if buffer is None:
            groups = [list(range(len(grads)))]
        else:
            plan = step.fusion_plan(grads, idx, self.backward_ranks, buffer)
            groups = [list(group.members) for group in plan.groups]
        if self.auto:
            return self.auto.exchange_groups(groups, idx)
        return groups, self._owner.exchange

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The plan over every built variable (members = variable indices), or ``None``."""
        return self._plan_of(self._variables) if self._owner.built else None

    def group_indices(self) -> list[list[int]]:
        """Variable indices of every fusion group (one group without a fusion buffer)."""
        return self._groups_of(self._variables if self._owner.built else [])

    def _plan_of(self, variables: Sequence[Any]) -> FusionPlan | None:
        """The fusion plan over ``variables`` (members = indices), ``None`` without a fusion
        buffer."""
        buffer = self._owner.fusion_buffer_bytes
        if buffer is None:
            return None
        specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        return step.fusion_plan(specs, range(len(specs)), self.backward_ranks, buffer)

    def _groups_of(self, variables: Sequence[Any]) -> list[list[int]]:
        """Indices into ``variables`` of every fusion group (one group without a buffer),
        planned once per set of shapes, dtypes, backward order and buffer (the build asks
        for them twice: :meth:`dense_for_good` and :meth:`bind`)."""
        key = ([(tuple(v.shape), v.dtype) for v in variables], self.backward_ranks,
               self._owner.fusion_buffer_bytes)
        if self._groups is not None and self._groups[0] == key:
            return [list(g) for g in self._groups[1]]
        plan = self._plan_of(variables) if variables else None
        groups = ([list(range(len(variables)))] if plan is None
                  else [list(g.members) for g in plan.groups])
        self._groups = key, groups
        return [list(g) for g in groups]

    def group_dtypes(self, groups: Sequence[Sequence[int]]) -> list[list[Any]]:
        """The dtypes of the variables of each of ``groups`` (variable indices)."""
        return [[self._variables[i].dtype for i in g] for g in groups]

    # -- automatic exchange and dense phase ----------------------------------------------
    def measure(self, compute_s: float | None = None) -> ExchangeDecision | None:
        """Measures the cluster and re-decides ``exchange="auto"`` (every worker must call
        it, eagerly in cross-replica context; re-trace the step afterwards).

        Args:
          compute_s: Measured seconds per step outside the exchange (``None``: not known,
            the policy's ``compute_prior`` times the compression time is assumed).

        Raises:
          ValueError: No automatic exchange, or not called eagerly in cross-replica context.
        """
        if self.auto is None:
            raise ValueError("measure_exchange() needs a built optimizer with exchange='auto'")
        return self.auto.measure(compute_s)

    @property
    def in_dense_phase(self) -> bool:
        """Whether the step is still traced as the dense exchange (``dense_steps``, see
        :mod:`~tf_blocksparse.keras.dense_phase`)."""
        return self.auto is not None and self.auto.dense_phase

    def update_dense_phase(self) -> bool:
        """Ends the dense phase once ``iterations`` reach ``dense_steps``: moves the state
        (every worker must call it, eagerly in cross-replica context, between steps).

        Returns:
          Whether it ended now; then re-trace the step (``model.fit`` does, see
          :class:`~tf_blocksparse.keras.dense_phase.DensePhaseCallback`).
        """
        owner = self._owner
        if not self.in_dense_phase or not owner.built or \
                int(owner.iterations.numpy()) < owner.compression.dense_steps:
            return False
        return self.auto.end_dense_phase()

    @property
    def chooser(self) -> auto_exchange.ExchangeChooser | None:
        """The automatic exchange's per-group chooser (``None`` for a fixed exchange)."""
        return None if self.auto is None else self.auto.chooser

    @property
    def decision(self) -> ExchangeDecision | None:
        """The automatic exchange's current choice and its measured inputs (else ``None``)."""
        chooser = self.chooser
        return None if chooser is None else chooser.decision

    def compression_seconds(self) -> float:
        """One replica's compression seconds per step with the exchange in use (its
        sparsely exchanged groups timed locally, no collective; 0 for dense)."""
        groups = self.group_indices()
        chooser = self.chooser
        modes = chooser.modes if chooser else [self._owner.exchange] * len(groups)
        sparse = [g for g, m in zip(groups, modes) if m != "dense"]
        return auto_exchange.compression_seconds(
            [self._compressor(g) for g in sparse], self.group_dtypes(sparse))

    def fit_callback_types(self) -> list[type]:
        """The callback classes ``model.fit`` needs for the owner: an
        :class:`~tf_blocksparse.auto.auto_callback.AutoExchangeCallback` with
        ``exchange="auto"`` and a choice (two or more candidates), a
        :class:`~tf_blocksparse.keras.dense_phase.DensePhaseCallback` with ``dense_steps``,
        a :class:`~tf_blocksparse.keras.local_steps.LocalStepsCallback` with ``sync_every``.

        ``tfbs.fit_callbacks(model, mine)`` adds those ``mine`` lacks (see
        :mod:`~tf_blocksparse.keras.fit_loop`); a loop with its own ``CallbackList`` adds
        them itself.
        """
        owner = self._owner
        out: list[type] = []
        if owner.compression.auto and not owner.exchange.pinned:
            out.append(auto_callback.AutoExchangeCallback)
        if owner.compression.dense_steps:
            out.append(dense_phase.DensePhaseCallback)
        if owner.sync_every is not None:
            out.append(local_steps.LocalStepsCallback)
        return out
