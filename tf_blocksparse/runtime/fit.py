"""``fit`` for the step-based trainers: Keras' training loop contract around ``train_step``.

:class:`FitLoop` gives :class:`~tf_blocksparse.PipelineTrainer` and
:class:`~tf_blocksparse.HybridTrainer` a ``fit(dataset, epochs, callbacks)`` that behaves like
``keras.Model.fit``: a ``keras.callbacks.CallbackList`` with the progress bar and ``History``,
``on_train_begin`` / ``on_epoch_begin`` / ``on_train_batch_end`` (``logs={"loss": ...}``) /
``on_epoch_end`` / ``on_train_end``, ``model.stop_training`` honoured (``EarlyStopping``,
``TerminateOnNaN``), and the trainer's weights written into the Keras model at the end of every
epoch, so callbacks that read or save ``model`` (``ModelCheckpoint``) see the trained values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import keras

__all__ = ["FitLoop"]


def _check_count(arg: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{arg} must be an int >= {minimum}"
                         f"{' or None' if allow_none else ''}, got {value!r}")


class FitLoop:
    """Mixin: needs ``self.model`` (a ``keras.Model``), ``self.train_step(x, y) -> loss``,
    ``self.copy_to_model()`` and ``self.primary_optimizer`` (the optimizer whose learning
    rate and iterations callbacks report; it becomes ``model.optimizer`` when the model has
    none, as after ``compile``)."""

    model: keras.Model

    @property
    def primary_optimizer(self) -> keras.optimizers.Optimizer:  # pragma: no cover
        raise NotImplementedError

    def train_step(self, x: Any, y: Any) -> Any:  # pragma: no cover - provided by the trainer
        raise NotImplementedError

    def copy_to_model(self) -> None:  # pragma: no cover - provided by the trainer
        raise NotImplementedError

    def fit(self, dataset: Iterable[tuple[Any, Any]], epochs: int = 1,
            steps_per_epoch: int | None = None,
            callbacks: Sequence[keras.callbacks.Callback] | None = None, verbose: int = 1,
            initial_epoch: int = 0) -> keras.callbacks.History:
        """Trains for ``epochs`` epochs, calling ``callbacks`` as ``keras.Model.fit`` does.

        Args:
            dataset: Global mini-batches ``(x [B, ...], y [B, ...])``: a ``tf.data.Dataset``
                or any re-iterable (each epoch iterates it again unless ``steps_per_epoch``
                is given, in which case one iterator is drawn from across epochs, as Keras
                does with an infinite dataset).  ``B`` must suit the trainer (e.g. be
                divisible by ``micro_batches``).
            epochs: Index of the last epoch (as in Keras: with ``initial_epoch``).
            steps_per_epoch: Steps per epoch; ``None``: until ``dataset`` is exhausted.
            callbacks: Keras callbacks (e.g. ``keras.callbacks.TensorBoard``).
            verbose: 0 silent, 1 progress bar, 2 one line per epoch.
            initial_epoch: Epoch to start at (resuming).

        Returns:
            The ``keras.callbacks.History`` (``history.history["loss"]``: mean loss per
            epoch).

        Raises:
            ValueError: Bad ``epochs``, ``steps_per_epoch``, ``verbose`` or ``initial_epoch``,
                or a ``dataset`` that yields no batch.
        """
        _check_count("epochs", epochs, 1)
        _check_count("initial_epoch", initial_epoch, 0)
        _check_count("steps_per_epoch", steps_per_epoch, 1, allow_none=True)
        if verbose not in (0, 1, 2):
            raise ValueError(f"verbose must be 0, 1 or 2, got {verbose!r}")
        if not hasattr(dataset, "__iter__"):
            raise ValueError(f"dataset must be an iterable of (x, y) batches, got {dataset!r}")
        cbs = keras.callbacks.CallbackList(
            list(callbacks or []), add_history=True, add_progbar=verbose != 0,
            model=self.model, verbose=verbose, epochs=epochs, steps=steps_per_epoch)
        history = next(c for c in cbs.callbacks if isinstance(c, keras.callbacks.History))
        if getattr(self.model, "optimizer", None) is None:
            self.model.optimizer = self.primary_optimizer
        self.model.stop_training = False
        iterator = iter(dataset) if steps_per_epoch is not None else None
        logs: dict[str, float] = {}
        cbs.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            cbs.on_epoch_begin(epoch)
            batches = iterator if iterator is not None else iter(dataset)
            total, step = 0.0, 0
            while steps_per_epoch is None or step < steps_per_epoch:
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                cbs.on_train_batch_begin(step)
                loss = float(self.train_step(x, y))
                total += loss
                step += 1
                cbs.on_train_batch_end(step - 1, {"loss": loss})
                if self.model.stop_training:
                    break
            if step == 0:
                raise ValueError("dataset yielded no batch in epoch "
                                 f"{epoch}{' (it ran out)' if iterator is not None else ''}")
            logs = {"loss": total / step if step else math.nan}
            self.copy_to_model()
            cbs.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        cbs.on_train_end(logs)
        return history
