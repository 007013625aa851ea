"""How :class:`~tf_blocksparse.keras.optimizer.BlockSparseOptimizer` takes part in
``model.fit``'s loop: callbacks the user passes, as Keras' own ``SwapEMAWeights`` or
Horovod's ``BroadcastGlobalVariablesCallback``.

Some of the wrapper's features act *between* steps, eagerly and on every worker together,
which a traced ``apply`` cannot do, and Keras calls nothing of an optimizer between the
steps of ``model.fit``; only callbacks run there:

- the automatic exchange's re-decisions (it times collectives, agrees on the figures and
  may re-trace the step: :class:`~tf_blocksparse.auto.auto_callback.AutoExchangeCallback`).
  Without it the build-time decision stays for the whole run;
- the end of a dense phase (``dense_steps``: it moves state and re-traces,
  :class:`~tf_blocksparse.keras.dense_phase.DensePhaseCallback`).  Without it the dense
  phase never ends;
- the synchronisation of local steps (``sync_every``) before every evaluation and backup
  (:class:`~tf_blocksparse.keras.local_steps.LocalStepsCallback`).  Without it each
  replica evaluates its own weights; the end of ``fit`` synchronises in any case
  (``finalize_variable_values``, which Keras calls there).

So pass them: ``model.fit(..., callbacks=tfbs.fit_callbacks(model, [*mine]))`` gives your
callbacks followed by the ones the model's optimizer needs and your list lacks
(:meth:`BlockSparseOptimizer.fit_callbacks` says the same for one optimizer).  The project
changes no Keras class to add them behind your back.  A step traced while a dense phase or
local steps run without their callback warns once, naming it (a custom loop that calls
``update_dense_phase()`` / ``synchronize()`` itself may ignore the warning).

This module imports no optimizer (the callbacks' modules are imported by the optimizer's):
the wrapper is recognised by its base class :class:`BlockSparseBase`, and the callbacks
derive from :class:`OptimizerCallback`, which finds it and notes that they run.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import keras

__all__ = ["BlockSparseBase", "MissingFitCallbackWarning", "OptimizerCallback",
           "find_block_sparse", "fit_callbacks"]


class MissingFitCallbackWarning(UserWarning):
    """A ``BlockSparseOptimizer`` feature that acts between steps has no callback running."""


#: Per optimizer, the names of the fit callbacks running now (between train begin and end).
_RUNNING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Optimizers already warned about a missing callback.
_WARNED: weakref.WeakSet = weakref.WeakSet()
#: Why each callback matters, for the warning (only those whose absence is a fault).
_NEEDED_FOR = {
    "DensePhaseCallback": "without it the dense phase (dense_steps) never ends",
    "LocalStepsCallback": "without it evaluations and backups during fit see each "
                          "replica's own weights (sync_every)",
}


class BlockSparseBase:
    """Base class of :class:`~tf_blocksparse.keras.optimizer.BlockSparseOptimizer`: what
    :func:`find_block_sparse` looks for, so that the callbacks need not import the
    optimizer (which imports them).

    Attributes:
      loss_scaled_by: ``None``; ``"agreed"`` once a
        :class:`~tf_blocksparse.keras.loss_scale.LossScaleOptimizer` wraps it, ``"keras"``
        once another loss-scale optimizer does (Keras' clears its inner optimizer's loss
        scale factor).
    """

    loss_scaled_by: str | None = None

    def fit_callback_types(self) -> list[type]:
        """The callback classes ``model.fit`` needs for this optimizer."""
        raise NotImplementedError

    def fit_callbacks(self, callbacks: Sequence[Any] = ()) -> list[Any]:
        """New instances of the :meth:`fit_callback_types` that ``callbacks`` lacks."""
        return [cls() for cls in self.fit_callback_types()
                if not any(isinstance(c, cls) for c in callbacks)]

    def warn_missing_fit_callbacks(self) -> None:
        """Warns once (:class:`MissingFitCallbackWarning`) when a callback this optimizer
        needs is not running (called as the step is traced)."""
        if self in _WARNED:
            return
        running = _RUNNING.get(self, {})
        missing = [cls.__name__ for cls in self.fit_callback_types()
                   if cls.__name__ in _NEEDED_FOR and not running.get(cls.__name__)]
        if not missing:
            return
        _WARNED.add(self)
        why = "; ".join(f"{name}: {_NEEDED_FOR[name]}" for name in missing)
        warnings.warn(
            f"BlockSparseOptimizer needs {', '.join(missing)} in model.fit ({why}). Pass "
            f"callbacks=tfbs.fit_callbacks(model, your_callbacks); a custom loop that calls "
            f"update_dense_phase() / synchronize() itself may ignore this warning",
            MissingFitCallbackWarning, stacklevel=3)


def running(optimizer: BlockSparseBase, callback: Any, on: bool) -> None:
    """Notes that ``callback`` runs (``on``) or stopped running in ``optimizer``'s fit."""
    counts = _RUNNING.setdefault(optimizer, {})
    name = type(callback).__name__
    counts[name] = max(0, counts.get(name, 0) + (1 if on else -1))


class OptimizerCallback(keras.callbacks.Callback):
    """Base of the callbacks a ``BlockSparseOptimizer`` needs in ``model.fit``: finds the
    model's optimizer and notes, from train begin to train end, that the callback runs (so
    that a traced step does not warn).  Subclasses override :meth:`train_begin` and
    :meth:`train_end` (called only when the model's optimizer is a ``BlockSparseOptimizer``)
    and Keras' other hooks.
    """

    @property
    def block_sparse(self) -> BlockSparseBase | None:
        """The ``BlockSparseOptimizer`` of the model being fitted, or ``None``."""
        return find_block_sparse(getattr(self.model, "optimizer", None))

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self.block_sparse
        if opt is not None:
            running(opt, self, True)
            self.train_begin(opt)

    def on_train_end(self, logs: dict | None = None) -> None:
        opt = self.block_sparse
        if opt is not None:
            try:
                self.train_end(opt)
            finally:
                running(opt, self, False)

    def train_begin(self, opt: Any) -> None:
        """Called at the start of ``fit`` with the model's ``BlockSparseOptimizer``."""

    def train_end(self, opt: Any) -> None:
        """Called at the end of ``fit`` with the model's ``BlockSparseOptimizer``."""


def find_block_sparse(optimizer: Any) -> BlockSparseBase | None:
    """The ``BlockSparseOptimizer`` inside ``optimizer`` (itself, or under loss scaling's
    ``inner_optimizer``), or ``None``."""
    while optimizer is not None:
        if isinstance(optimizer, BlockSparseBase):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def fit_callbacks(model: Any, callbacks: Sequence[Any] | None = None) -> list[Any]:
    """``callbacks`` followed by the callbacks ``model``'s optimizer needs in
    ``model.fit`` that they lack: pass the result as ``model.fit(callbacks=...)``.

    Args:
      model: A compiled Keras model (its optimizer may be a ``BlockSparseOptimizer``, also
        under a loss-scale optimizer, or any other: then nothing is added).
      callbacks: The user's own callbacks (``None``: none).

    Returns:
      A new list: ``[*callbacks, *needed]``.

    Raises:
      ValueError: ``model`` has no optimizer (not compiled).
    """
    mine = list(callbacks or [])
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError("`model` has no optimizer: call model.compile(optimizer=...) before "
                         "tfbs.fit_callbacks(model)")
    opt = find_block_sparse(optimizer)
    return mine if opt is None else [*mine, *opt.fit_callbacks(mine)]
