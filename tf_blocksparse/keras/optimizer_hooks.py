"""What ``BlockSparseOptimizer`` answers when Keras saves it or training ends, and the
controls of its local-steps window.

Keras calls ``save_own_variables``/``load_own_variables`` when saving and loading a model,
``finalize_variable_values`` when ``fit`` ends, and sets ``gradient_accumulation_steps`` as it
constructs an optimizer; the wrapper's answers need only its parts (its
:class:`~tf_blocksparse.keras.keras_saving.KerasSaving` and, with ``sync_every``, its
:class:`~tf_blocksparse.keras.local_steps.LocalSteps`), so they live in the mixin
:class:`WrapperHooks` rather than beside construction, ``build`` and ``apply``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras

if TYPE_CHECKING:
    from tf_blocksparse.keras.keras_saving import KerasSaving
    from tf_blocksparse.keras.local_steps import LocalSteps

__all__ = ["WrapperHooks"]


class WrapperHooks:
    """Saving, the end of training and the local-steps window of ``BlockSparseOptimizer``."""

    _saving: KerasSaving
    _local: LocalSteps | None
    accumulation_steps: int
    sync_every: int | None

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """Micro-steps accumulated locally per exchange (``None``: one, every step)."""
        every = getattr(self, "accumulation_steps", 1)  # unset while Keras' __init__ runs
        return None if every == 1 else every

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int | None) -> None:
        if value:  # Keras' constructor sets None; the wrapper's own is the constructor's
            raise AttributeError("gradient_accumulation_steps is set by the constructor")

    @property
    def steps_per_exchange(self) -> int:
        """Training steps per exchange: ``gradient_accumulation_steps``, ``sync_every``, or
        1 (every step exchanges)."""
        return self.accumulation_steps if self.accumulation_steps > 1 else (
            self.sync_every or 1)

    def modes_changed(self) -> None:
        """The automatic exchange changed some group's mode (after moving its state):
        traced functions of the exchange other than Keras' train function are dropped
        (with ``sync_every``, the eager synchronisation)."""
        if self._local is not None:
            self._local.retrace()

    # -- saving --------------------------------------------------------------------------
    def replica_state_apart(self) -> contextlib.AbstractContextManager[None]:
        """Within it, Keras saving leaves out the per-replica state (residuals, velocities,
        clipping state) and loading expects it left out: ``BackupAndRestore`` saves that
        state per worker instead (:mod:`tf_blocksparse.keras.replica_state`), since a
        cross-replica read of it is an all-reduce.  Outside it (``model.save``), the state is
        saved as its sum over replicas and a load gives every replica ``sum / N``."""
        return self._saving.apart()

    def save_own_variables(self, store: Any) -> None:
        """Saves the state with no collective, so any worker may save alone (``model.save``
        on the chief only, as Horovod users do): per-replica state is saved as its sum over
        replicas, exact on one worker and estimated from this worker's replicas on several
        (:func:`~tf_blocksparse.keras.replica_state.cluster_value`)."""
        self._saving.save(store, self.variables,
                          self._distribution_strategy.num_replicas_in_sync)

    def load_own_variables(self, store: Any) -> None:
        """Loads a full save (``model.save``: per-replica state as sums) or, within
        :meth:`replica_state_apart`, one without the per-replica state."""
        self._saving.load(store, self.variables, self.name)

    # -- the local-steps window ----------------------------------------------------------
    @property
    def local_variables(self) -> list[keras.Variable]:
        """Mirrored variables whose replicas' copies differ between synchronisations with
        ``sync_every`` (else []): the inner optimizer's state and the trained weights.
        Backups save every replica's copy per worker, as the per-replica state, so a run
        backed up inside a window resumes exactly."""
        if self._local is None or not self.built:
            return []
        return self._local.local_variables()

    def finalize_variable_values(self, var_list: Sequence[keras.Variable]) -> None:
        """Called by ``model.fit`` when training ends: local steps are synchronised first
        (:meth:`synchronize`), so the trained model holds the same weights everywhere."""
        self.synchronize()
        self.inner_optimizer.finalize_variable_values(var_list)

    def synchronize(self) -> None:
        """Exchanges the progress of the current window of ``sync_every`` now (a partial
        window like a full one), so every replica holds the same weights: call it on every
        worker, eagerly in cross-replica context, before evaluating or saving in a custom
        loop (``model.fit`` does with its ``LocalStepsCallback``, see
        :func:`~tf_blocksparse.keras.fit_loop.fit_callbacks`, and when it ends).  Nothing
        happens without ``sync_every``, before the optimizer is built, or when the window is
        empty."""
        if self._local is not None and self.built:
            self._local.synchronize()

    def restart_window(self) -> None:
        """Takes the model's current weights as the last synchronised ones (the anchors),
        when the window is empty (eagerly, cross-replica context): weights loaded after the
        optimizer was built are then trained from, not overwritten at the next exchange."""
        if self._local is not None and self.built:
            self._local.restart_window()
