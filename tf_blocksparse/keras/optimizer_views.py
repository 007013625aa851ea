"""Read access to ``BlockSparseOptimizer``'s parts: its per-replica state, its exchange
schedule and its reported figures.

The wrapper (:mod:`~tf_blocksparse.keras.optimizer`) holds its state in a
:class:`~tf_blocksparse.keras.optimizer_state.WrapperState`, its changing exchange in an
:class:`~tf_blocksparse.keras.exchange_schedule.ExchangeSchedule` and its figures in a
:class:`~tf_blocksparse.keras.step_metrics.StepMetrics`; :class:`WrapperViews` gives them the
optimizer's public names, so the class itself keeps only construction, ``build``, ``apply``
and saving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras

from tf_blocksparse.planning.exchange_decision import ExchangeDecision

if TYPE_CHECKING:
    from tf_blocksparse.auto.auto_exchange import ExchangeChooser
    from tf_blocksparse.auto.auto_runtime import AutoExchangeRuntime
    from tf_blocksparse.fusion import FusionPlan
    from tf_blocksparse.keras.exchange_schedule import ExchangeSchedule
    from tf_blocksparse.keras.optimizer_state import WrapperState
    from tf_blocksparse.keras.step_metrics import StepMetrics

__all__ = ["WrapperViews"]


class WrapperViews:
    """The state, schedule and figures of ``BlockSparseOptimizer`` under its public names."""

    _state: WrapperState | None
    _schedule: ExchangeSchedule
    _metrics: StepMetrics

    # -- per-replica state ---------------------------------------------------------------
    @property
    def clip_states(self) -> list[list[keras.Variable]]:
        """Per variable, the state of each stateful clipping rule (per replica)."""
        return [] if self._state is None else [list(s) for s in self._state.clip_states]

    @property
    def velocities(self) -> list[keras.Variable]:
        """Per-variable local momentum of ``momentum_correction`` (per replica; else [])."""
        return [] if self._state is None else list(self._state.velocities)

    @property
    def residuals(self) -> list[keras.Variable]:
        """Per-variable residuals (per replica; a cross-replica read returns their sum)."""
        return [] if self._state is None else list(self._state.residuals)

    # -- exchange schedule (see ExchangeSchedule) ----------------------------------------
    @property
    def _auto(self) -> AutoExchangeRuntime | None:
        """The changing exchange's runtime (:attr:`ExchangeSchedule.auto`)."""
        return self._schedule.auto

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """See :attr:`ExchangeSchedule.fusion_plan`."""
        return self._schedule.fusion_plan

    def measure_exchange(self, compute_s: float | None = None) -> ExchangeDecision | None:
        """See :meth:`ExchangeSchedule.measure`."""
        return self._schedule.measure(compute_s)

    @property
    def in_dense_phase(self) -> bool:
        """See :attr:`ExchangeSchedule.in_dense_phase`."""
        return self._schedule.in_dense_phase

    def update_dense_phase(self) -> bool:
        """See :meth:`ExchangeSchedule.update_dense_phase`."""
        return self._schedule.update_dense_phase()

    def fit_callback_types(self) -> list[type]:
        """See :meth:`ExchangeSchedule.fit_callback_types`; :meth:`fit_callbacks` gives
        new instances of those a list lacks."""
        return self._schedule.fit_callback_types()

    @property
    def exchange_chooser(self) -> ExchangeChooser | None:
        """See :attr:`ExchangeSchedule.chooser`."""
        return self._schedule.chooser

    @property
    def exchange_decision(self) -> ExchangeDecision | None:
        """See :attr:`ExchangeSchedule.decision`."""
        return self._schedule.decision

    def compression_seconds(self) -> float:
        """See :meth:`ExchangeSchedule.compression_seconds`."""
        return self._schedule.compression_seconds()

    # -- figures (see StepMetrics) -------------------------------------------------------
    def block_sparse_metrics(self, mean: bool = False) -> dict[str, Any]:
        """See :meth:`StepMetrics.figures`."""
        return self._metrics.figures(mean)

    def reset_metric_means(self) -> None:
        """See :meth:`StepMetrics.reset_means`."""
        self._metrics.reset_means()
