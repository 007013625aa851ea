"""Small convolutional classifiers."""

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
