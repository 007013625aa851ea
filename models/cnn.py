"""Small convolutional classifiers: ``cnn_small`` (two conv blocks) and ``cnn_bn`` (four
conv-BatchNorm blocks)."""

from __future__ import annotations

import keras


def cnn_small(input_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
              seed: int | None = None) -> keras.Model:
    """A small CNN: two conv blocks and a dense head (~0.1M parameters at 28x28).

    Args:
      input_shape: ``(height, width, channels)``; works from 8x8 up.
      num_classes: Output logits.
      seed: Optional seed for the initialisers.

    Returns:
      An uncompiled ``keras.Sequential`` producing logits [batch, num_classes].
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    pool = input_shape[0] >= 16
    layers = [keras.Input(input_shape),
              keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")]
    if pool:
        layers.append(keras.layers.MaxPooling2D(name="pool1"))
    layers += [keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
               keras.layers.MaxPooling2D(name="pool2"), keras.layers.Flatten(name="flatten"),
               keras.layers.Dense(64, activation="relu", name="fc1"),
               keras.layers.Dense(num_classes, name="logits")]
    return keras.Sequential(layers, name="cnn_small")


def cnn_bn(input_shape: tuple[int, int, int] = (32, 32, 3), num_classes: int = 10,
           seed: int | None = None) -> keras.Model:
    """Four conv blocks of growing width with BatchNorm, and a dense head.

    Per block: a bias-free 3x3 ``Conv2D`` (8, 16, 32, 64 filters), ``BatchNormalization``,
    ``ReLU`` and 2x2 max pooling (``same`` padding); then ``Flatten``, ``Dense(64)`` with
    ReLU and the logits.  Its variables vary in size and kind (conv kernels, BatchNorm
    scales and offsets, dense weights and biases), which the fusion and clipping benchmarks
    need.

    Args:
      input_shape: ``(height, width, channels)``; works from 8x8 up.
      num_classes: Output logits.
      seed: Optional seed for the initialisers.

    Returns:
      An uncompiled ``keras.Sequential`` producing logits [batch, num_classes].
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    layers = [keras.Input(input_shape)]
    for width in (8, 16, 32, 64):
        layers += [keras.layers.Conv2D(width, 3, padding="same", use_bias=False),
                   keras.layers.BatchNormalization(), keras.layers.ReLU(),
                   keras.layers.MaxPooling2D(2, padding="same")]
    layers += [keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
               keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="cnn_bn")
