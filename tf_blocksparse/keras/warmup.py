"""``DensityWarmup``: DGC-style sparsity warm-up for :class:`BlockSparseOptimizer`.

Deep Gradient Compression (Lin et al., ICLR 2018, Sec. 3.3) starts training with a mild
sparsity and tightens it over the first epochs (75%, 93.75%, 98.4375%, 99.6%, 99.9%), because
the early, fast-changing gradients suffer most from the delay that error feedback puts on the
blocks that are not sent.  This callback gives epoch ``e`` the density ``densities[e]``; from
``len(densities)`` on the optimizer runs with its own ``k`` / ``density`` again.

How: the number of blocks kept is fixed when the step is traced (it sets the shapes of the
exchanged buffers), so at each epoch whose density differs from the previous one the callback
sets the optimizer's ``density`` and asks the model for a freshly traced train function.  The
residuals (error feedback), velocities and clipping state are variables of the optimizer and
carry over unchanged.  Under ``MultiWorkerMirroredStrategy`` every worker runs the callback at
the same epoch boundary (Keras runs callbacks on every worker), so all re-trace together.

A warm-up counted in optimizer steps that sends everything densely is the optimizer's
``dense_steps`` option (:mod:`~tf_blocksparse.keras.dense_phase`); the two combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from tf_blocksparse.keras.fit_loop import find_block_sparse


class DensityWarmup(keras.callbacks.Callback):
    """Per-epoch density for the first epochs of ``model.fit``.

    Args:
      densities: Density (fraction of blocks, or of elements for ``granularity="element"``)
        for epochs ``0 .. len(densities) - 1``; each in (0, 1].  ``1.0`` exchanges everything
        (nothing is delayed).  E.g. DGC's schedule for a final 0.1%:
        ``[0.25, 0.0625, 0.015625, 0.004]``.

    Raises:
      ValueError: ``densities`` is empty or holds a value outside (0, 1].
    """

    def __init__(self, densities: Sequence[float]):
        super().__init__()
        if isinstance(densities, (str, bytes)) or not isinstance(densities, Sequence):
            raise ValueError(f"`densities` must be a sequence of floats, got {densities!r}")
        values = list(densities)
        if not values:
            raise ValueError("`densities` must hold at least one density")
        for i, d in enumerate(values):
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
                raise ValueError(f"`densities[{i}]` must be a number in (0, 1], got {d!r}")
        self.densities = [float(d) for d in values]
        self._final: tuple[int | None, float | None] | None = None
        self._current: tuple[int | None, float | None] | None = None

    def _optimizer(self) -> Any:
        opt = find_block_sparse(getattr(self.model, "optimizer", None))
        if opt is None:
            raise ValueError("DensityWarmup needs a model compiled with a "
                             "tfbs.BlockSparseOptimizer")
        if opt.exchange == "dense":
            raise ValueError("DensityWarmup needs a sparse exchange; the optimizer has "
                             "exchange='dense'")
        return opt

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self._optimizer()
        if self._final is None:
            self._final = (opt.k, opt.density)
        self._current = (opt.k, opt.density)

    def density_at(self, epoch: int) -> tuple[int | None, float | None]:
        """``(k, density)`` the optimizer uses in ``epoch``."""
        if self._final is None:
            raise ValueError("density_at() is known once training began")
        if epoch < len(self.densities):
            return None, self.densities[epoch]
        return self._final

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        wanted = self.density_at(epoch)
        if wanted == self._current:
            return
        opt = self._optimizer()
        opt.k, opt.density = wanted
        self._current = wanted
        self.model.make_train_function(force=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._final is not None and self._current != self._final:
            opt = self._optimizer()
            opt.k, opt.density = self._final
            self._current = self._final
            self.model.make_train_function(force=True)
