"""The loss of the step-based trainers: per-example values, and each slice's share of the mean.

:class:`~tf_blocksparse.pipeline.trainer.PipelineTrainer` and
:class:`~tf_blocksparse.hybrid.trainer.HybridTrainer` compute the loss on slices of
the mini-batch held by different replicas; each slice contributes
``sum(per-example losses) / (B * elements per example)``, so the contributions (and their
gradients) add up to those of the full-batch mean loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["LossFn", "loss_part", "per_example_loss"]

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def per_example_loss(loss: Any) -> LossFn:
    """An unreduced loss function ``(y_true, y_pred) -> [b, ...]`` from a Keras loss spec.

    Args:
        loss: A ``keras.losses.Loss`` (its unreduced ``call`` is used), a loss name, or a
            function returning per-example losses [b] or [b, ...].

    Raises:
        ValueError: ``loss`` is none of these.
    """
    if isinstance(loss, keras.losses.Loss):
        return loss.call  # the unreduced values; the trainer does the reduction
    if isinstance(loss, str):
        fn = keras.losses.get(loss)
        return fn.call if isinstance(fn, keras.losses.Loss) else fn
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a keras Loss, a loss name or a callable, got {loss!r}")


def loss_part(loss_fn: LossFn, y: tf.Tensor, logits: tf.Tensor, batch: int) -> tf.Tensor:
    """One slice's share of the full-batch mean loss: ``sum(per-example loss) / (B * elems)``.

    Args:
        loss_fn: Per-example loss, ``(y [b, ...], logits [b, ...]) -> [b] or [b, ...]``.
        y: Targets of the slice [b, ...].
        logits: Outputs of the slice [b, ...].
        batch: The full mini-batch size B.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: ``loss_fn`` returns a scalar.
    """
    values = loss_fn(y, logits)
    if values.shape.rank == 0:
        raise ValueError("loss must return per-example values [b] or [b, ...], got a scalar")
    per_example = math.prod(int(d) for d in values.shape[1:])
    return tf.reduce_sum(values) / tf.cast(batch * per_example, values.dtype)
