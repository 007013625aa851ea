"""Exact evaluation under any ``tf.distribute`` strategy: every example counted once.

``model.evaluate`` under ``MultiWorkerMirroredStrategy`` on a data set that is not sharded
(auto-shard ``OFF``, the whole test set on every worker) does not compute the test set's
accuracy: the global batch is re-split across the workers' replicas, so some examples are
counted twice and others not at all, and padding slots of the last batch are counted too.
:func:`evaluate_exactly` instead gives replica ``r`` of ``R`` the contiguous slice
``[r*N//R, (r+1)*N//R)`` of the ``N`` examples, pads every slice to the same number of
batches with zero-weight rows (so every replica runs the same collectives), and sums three
numbers over replicas after every batch: the summed loss, the correct predictions and the
counted units.  The result equals a single-process evaluation of the same weights on the
same examples (up to float summation order), for any number of workers and any batch size.

A *unit* is one example for classifiers (labels ``[N]``, predictions ``[N, C]``) and one
label position for sequence outputs (labels ``[N, T]``, predictions ``[N, T, C]``); positions
whose label equals ``ignore_label`` are not counted (padding tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["EvalResult", "ExactValidation", "evaluate_exactly", "per_unit_loss"]

_SUM = tf.distribute.ReduceOp.SUM


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Outcome of :func:`evaluate_exactly`.

    Attributes:
      loss: Mean loss over the counted units (plus the model's regularisation losses, as
        ``model.evaluate`` adds them).
      accuracy: ``correct / counted``.
      correct: Counted units whose arg-max prediction equals the label.
      counted: Units counted (examples for classifiers, non-ignored positions for sequences).
      examples: Examples (rows) evaluated: every one exactly once.
    """

    loss: float
    accuracy: float
    correct: int
    counted: int
    examples: int


def per_unit_loss(loss: Any) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The un-reduced form of a compiled loss: ``fn(y_true, y_pred) -> [N]`` or ``[N, T]``.

    Args:
      loss: A ``keras.losses.Loss`` (its reduction is bypassed), a loss name, or a function
        that already returns one value per unit.

    Raises:
      ValueError: ``loss`` is ``None`` (the model is not compiled) or not a loss.
    """
    if loss is None:
        raise ValueError("`loss`: the model has no compiled loss; compile it or pass `loss=`")
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    if isinstance(loss, str):
        return keras.losses.get(loss)
    if callable(loss):
        return loss
    raise ValueError(f"`loss` must be a keras Loss, a loss name or a function, got {loss!r}")


def _num_rows(x: Any) -> int:
    return int(len(tf.nest.flatten(x)[0]))


def _check_inputs(x: Any, y: Any, batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size!r}")
    rows = {len(a) for a in tf.nest.flatten(x)}
    if len(rows) != 1:
        raise ValueError(f"`x`: every input array needs the same number of rows, got {rows}")
    n = rows.pop()
    if len(y) != n:
        raise ValueError(f"`y` has {len(y)} rows, `x` has {n}")
    if n == 0:
        raise ValueError("`x` is empty: nothing to evaluate")
    return n


class _Evaluator:
    """Shards, pads and evaluates ``(x, y)`` on every replica of ``strategy``."""

    def __init__(self, model: keras.Model, strategy: tf.distribute.Strategy,
                 loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
                 ignore_label: int | None):
        self.model, self.strategy, self.loss_fn = model, strategy, loss_fn
        self.ignore_label = ignore_label
        self._step = tf.function(self._step_impl, autograph=False)

    def _replica_fn(self, x: Any, y: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """Sums of one replica's batch: ``(loss [float64], correct, counted)`` (int64)."""
        pred = self.model(x, training=False)
        per = tf.cast(self.loss_fn(y, pred), tf.float64)
        if per.shape.rank != y.shape.rank:
            raise ValueError(
                f"`loss` must return one value per label (shape {y.shape}), got shape "
                f"{per.shape}; pass an un-reduced `loss=` (e.g. keras.losses."
                f"sparse_categorical_crossentropy)")
        mask = tf.reshape(w, [-1] + [1] * (y.shape.rank - 1))
        mask = tf.broadcast_to(mask, tf.shape(y))
        if self.ignore_label is not None:
            mask = tf.logical_and(mask, tf.not_equal(y, tf.cast(self.ignore_label, y.dtype)))
        hit = tf.equal(tf.cast(tf.argmax(pred, axis=-1), tf.int64), tf.cast(y, tf.int64))
        if self.model.losses:  # regularisation: model.evaluate adds it to every batch's mean
            per += tf.cast(tf.add_n(self.model.losses), tf.float64)
        fmask = tf.cast(mask, tf.float64)
        return (tf.reduce_sum(per * fmask),
                tf.reduce_sum(tf.cast(tf.logical_and(hit, mask), tf.int64)),
                tf.reduce_sum(tf.cast(mask, tf.int64)))

    def _step_impl(self, x: Any, y: Any, w: Any) -> tuple[tf.Tensor, ...]:
        out = self.strategy.run(self._replica_fn, args=(x, y, w))
        return tuple(self.strategy.reduce(_SUM, v, axis=None) for v in out)

    def __call__(self, x: Any, y: np.ndarray, batch_size: int) -> EvalResult:
        n = _check_inputs(x, y, batch_size)
        replicas = self.strategy.num_replicas_in_sync
        per_replica = max(1, math.ceil(batch_size / replicas))
        bounds = [(r * n // replicas, (r + 1) * n // replicas) for r in range(replicas)]
        steps = math.ceil(max(hi - lo for lo, hi in bounds) / per_replica)
        totals = [0.0, 0, 0]
        for s in range(steps):
            def value_fn(ctx: tf.distribute.ValueContext, s: int = s) -> tuple:
                lo, hi = bounds[ctx.replica_id_in_sync_group]
                rows = np.arange(lo + s * per_replica, lo + (s + 1) * per_replica)
                weight = rows < hi  # padding slots: weight 0, any valid row (row 0)
                idx = np.where(weight, rows, 0)
                take = lambda a: tf.constant(np.asarray(a)[idx])  # noqa: E731
                return tf.nest.map_structure(take, x), take(y), tf.constant(weight)

            args = self.strategy.experimental_distribute_values_from_function(value_fn)
            loss_sum, correct, counted = self._step(*args)
            totals[0] += float(loss_sum)
            totals[1] += int(correct)
            totals[2] += int(counted)
        counted = totals[2]
        return EvalResult(loss=totals[0] / counted if counted else float("nan"),
                          accuracy=totals[1] / counted if counted else float("nan"),
                          correct=totals[1], counted=counted, examples=n)


def evaluate_exactly(model: keras.Model, x: Any, y: Any, batch_size: int = 256,
                     loss: Any = None, ignore_label: int | None = None) -> EvalResult:
    """Loss and accuracy of ``model`` over every example of ``(x, y)`` exactly once.

    Works under the strategy the model was built in (``MultiWorkerMirroredStrategy``,
    ``MirroredStrategy``, none); under a multi-worker strategy every worker must call it
    with the same ``(x, y)`` (the whole evaluation set; each replica evaluates its own
    slice) and gets the same result.

    Args:
      model: A built Keras model producing scores ``[N, C]`` or ``[N, T, C]``.
      x: Inputs, an array ``[N, ...]`` or a tuple/list of arrays with ``N`` rows.
      y: Integer labels ``[N]`` or ``[N, T]``.
      batch_size: Global batch (split evenly over the replicas).
      loss: Optional un-reduced loss ``fn(y_true, y_pred)``; default: the model's compiled
        loss (see :func:`per_unit_loss`).
      ignore_label: Label value not counted (e.g. a padding token).

    Returns:
      An :class:`EvalResult` (the same on every worker).

    Raises:
      ValueError: Mismatched or empty inputs, bad ``batch_size``, no usable loss.
    """
    source = model.loss if loss is None else loss
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    # Keyed by the loss as given (``Loss.call`` is a new bound method on every access), so a
    # callback evaluating every epoch reuses one traced step; the evaluator keeps it alive.
    cache = model.__dict__.setdefault("_tfbs_exact_evaluators", {})
    key = (id(strategy), id(source), ignore_label)
    if key not in cache:
        cache[key] = _Evaluator(model, strategy, per_unit_loss(source), ignore_label)
    return cache[key](x, np.asarray(y), batch_size)  # checks the inputs first


class ExactValidation(keras.callbacks.Callback):
    """Validation with :func:`evaluate_exactly` after every epoch, into the epoch's logs.

    Writes ``val_loss``, ``val_<metric_name>``, ``val_correct`` and ``val_counted`` into the
    logs, so ``History``, ``TensorBoard``, early stopping and checkpoints that come after it
    in the callback list see exact figures.  Use it instead of ``validation_data`` (put it
    first among the callbacks).

    Args:
      x: Validation inputs (every worker passes the whole set).
      y: Validation labels.
      batch_size: Global batch.
      loss: Optional un-reduced loss (default: the compiled loss).
      ignore_label: Label value not counted.
      metric_name: Name of the accuracy in the logs (``val_`` is prefixed).
      verbose: Print the figures after every epoch (the chief should, others not).
    """

    def __init__(self, x: Any, y: Any, batch_size: int = 256, loss: Any = None,
                 ignore_label: int | None = None, metric_name: str = "accuracy",
                 verbose: bool = False):
        super().__init__()
        self.x, self.y = x, np.asarray(y)
        _check_inputs(self.x, self.y, batch_size)
        self.batch_size, self.loss = batch_size, loss
        self.ignore_label, self.metric_name, self.verbose = ignore_label, metric_name, verbose
        self.last: EvalResult | None = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        r = evaluate_exactly(self.model, self.x, self.y, self.batch_size, self.loss,
                             self.ignore_label)
        self.last = r
        if logs is not None:
            logs.update({"val_loss": r.loss, f"val_{self.metric_name}": r.accuracy,
                         "val_correct": r.correct, "val_counted": r.counted})
        if self.verbose:
            print(f"epoch {epoch + 1}: val_loss {r.loss:.4f} val_{self.metric_name} "
                  f"{r.accuracy:.4f} ({r.correct}/{r.counted})", flush=True)
