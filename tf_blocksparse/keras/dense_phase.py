"""The dense phase of :class:`~tf_blocksparse.keras.optimizer.BlockSparseOptimizer`
(``dense_steps=N``): the first ``N`` optimizer steps send the dense all-reduce, as PyTorch
PowerSGD's ``start_powerSGD_iter``; then the configured exchange takes over.

While it lasts, every fusion group is exchanged as ``exchange="dense"`` would: no residual or
velocity is read or written, an inner ``SGD``'s momentum is its own (the dense exchange's
weights and bytes, bit for bit).  Its end is one switch from dense, at an optimizer step
boundary, made eagerly on every worker together: the inner SGD's momentum ``M`` moves into
the per-replica velocities of momentum correction (``u = -M / (lr N)``, so the momentum
continues), the residuals start at zero (nothing was delayed), and the step is re-traced
(see :mod:`~tf_blocksparse.auto.mode_switch`).

In ``model.fit`` :class:`DensePhaseCallback` ends it: pass it (``tfbs.fit_callbacks(model)``
adds it when the optimizer has a dense phase, :mod:`~tf_blocksparse.keras.fit_loop`; a step
traced without it warns).  After every batch it compares the optimizer's
``iterations`` (the steps applied: a step skipped as non-finite does not count) with ``N``,
also at the start of training, so a run resumed from a backup past ``N`` switches before its
first step.  With ``steps_per_execution > 1`` the switch waits for the end of the execution.
A custom loop calls :meth:`BlockSparseOptimizer.update_dense_phase` between steps and
re-traces its step function when it returns ``True``.
"""

from __future__ import annotations

from typing import Any

from tf_blocksparse.keras import fit_loop

__all__ = ["DensePhaseCallback"]


class DensePhaseCallback(fit_loop.OptimizerCallback):
    """Ends the optimizer's dense phase (``dense_steps``) during ``model.fit`` once its
    ``iterations`` reach ``dense_steps``, and has Keras re-trace the train function.

    ``tfbs.fit_callbacks(model, mine)`` adds one when the model's optimizer has a dense
    phase and ``mine`` holds none.  Every worker runs callbacks, so all switch at the same
    step.
    """

    def _update(self, opt: Any) -> None:
        if opt is not None and opt.in_dense_phase and opt.update_dense_phase():
            self.model.make_train_function(force=True)

    def train_begin(self, opt: Any) -> None:
        self._update(opt)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._update(self.block_sparse)
