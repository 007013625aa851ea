"""How :class:`~tf_blocksparse.keras.optimizer.BlockSparseOptimizer` takes part in
``model.fit``'s loop, and how the parts that act there find it.

Two of the wrapper's features act *between* steps, eagerly and on every worker together,
which a traced ``apply`` cannot do: the automatic exchange's re-decision (it times
collectives, agrees on the figures and may re-trace the step:
:class:`~tf_blocksparse.auto.auto_exchange.AutoExchangeCallback`) and the end of a dense
phase (it moves state and re-traces:
:class:`~tf_blocksparse.keras.dense_phase.DensePhaseCallback`).  Keras calls nothing of an
optimizer between the steps of ``model.fit``; only callbacks run there.  So the wrapper
says which callbacks it needs (:meth:`BlockSparseOptimizer.fit_callbacks`), and:

- ``model.fit`` gets them without the user adding anything: the optimizer's module
  registers :func:`missing_fit_callbacks` with
  :func:`tf_blocksparse._compat.extend_callback_lists`, the project's one hook into Keras'
  ``CallbackList`` (contract-tested per Keras version).  It adds callbacks only to the
  lists ``fit`` builds for a model whose optimizer is (or wraps) a ``BlockSparseOptimizer``
  that needs them, and never doubles one the user gave;
- a training loop that builds its own ``CallbackList``, or a user who wants to see the
  callbacks, passes ``callbacks=[*mine, *opt.fit_callbacks(mine)]`` explicitly.

This module imports no optimizer (the callbacks' modules are imported by the optimizer's):
the wrapper is recognised by its base class :class:`BlockSparseBase`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BlockSparseBase", "find_block_sparse", "missing_fit_callbacks"]


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

    def fit_callbacks(self, callbacks: Sequence[Any] = ()) -> list[Any]:
        """The callbacks ``model.fit`` needs for this optimizer that ``callbacks`` lacks."""
        raise NotImplementedError


def find_block_sparse(optimizer: Any) -> BlockSparseBase | None:
    """The ``BlockSparseOptimizer`` inside ``optimizer`` (itself, or under loss scaling's
    ``inner_optimizer``), or ``None``."""
    while optimizer is not None:
        if isinstance(optimizer, BlockSparseBase):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def missing_fit_callbacks(model: Any, callbacks: Sequence[Any]) -> list[Any]:
    """The callbacks ``model``'s optimizer needs in ``model.fit`` that ``callbacks`` lacks
    (none where it is no ``BlockSparseOptimizer``)."""
    opt = find_block_sparse(getattr(model, "optimizer", None))
    return [] if opt is None else opt.fit_callbacks(callbacks)
