"""NumPy arrays as ``model.fit`` input that trains on the same batches as
``model.fit(x, y, batch_size=..., shuffle=False)`` but costs less to start.

From arrays Keras makes a new distributed input iterator at every epoch's start and another
at its end; under ``MirroredStrategy`` each one traces a dozen small functions (about a tenth
of a CPU-second). From a repeated dataset with ``steps_per_epoch`` it makes one per fit.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf


def in_order(x: np.ndarray, y: np.ndarray, batch_size: int = 16) -> tuple[tf.data.Dataset, int]:
    """The batches of ``(x, y)`` in order, repeated without end, and the number of batches in
    one pass (the last one partial where ``batch_size`` does not divide ``len(x)``).

    Args:
        x: Inputs, shape ``[n, ...]``.
        y: Targets, shape ``[n, ...]``.
        batch_size: Examples per batch (the global batch under a strategy).

    Returns:
        The dataset and the ``steps_per_epoch`` that makes one epoch one pass.
    """
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()
    return data, math.ceil(len(x) / batch_size)


def fit_in_order(model: keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int,
                 epochs: int = 1, **kwargs: Any) -> keras.callbacks.History:
    """``model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
    **kwargs)`` through :func:`in_order`."""
    data, steps = in_order(x, y, batch_size)
    return model.fit(data, steps_per_epoch=steps, epochs=epochs, shuffle=False, verbose=0,
                     **kwargs)
