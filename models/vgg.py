"""VGG-style CNN with a large fully-connected head (communication bound)."""

from __future__ import annotations

import keras

CONV_BLOCKS = ((32, 32), (64, 64))


def vgg_fc(input_shape: tuple[int, int, int] = (28, 28, 1), num_classes: int = 10,
           fc_units: int = 1024, seed: int | None = None) -> keras.Model:
    """Two VGG conv blocks followed by a large dense head.

    ``conv1_1, conv1_2, pool1, conv2_1, conv2_2, pool2`` (3x3 "same" convs with ReLU, 2x2
    max pooling, skipped where the spatial size would drop below 2), then the boundary
    ``flatten``, then ``fc1`` and ``fc2`` (``fc_units`` each, ReLU) and ``logits``.  With the
    defaults at 28x28x1 the head (``fc1``, ``fc2``, ``logits``) holds ~98% of the ~4.3M
    parameters, so gradient exchange is dominated by dense layers.

    Args:
      input_shape: ``(height, width, channels)``; e.g. 28x28x1, 32x32x3, 8x8x1.
      num_classes: Output logits.
      fc_units: Width of ``fc1`` and ``fc2``.
      seed: Optional seed for the initialisers (sets Keras' global random seed).

    Returns:
      An uncompiled ``keras.Sequential`` mapping images [batch, h, w, c] to logits
      [batch, num_classes].
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    layers: list[keras.layers.Layer] = [keras.Input(input_shape)]
    height, width = input_shape[0], input_shape[1]
    for b, filters in enumerate(CONV_BLOCKS, start=1):
        for c, f in enumerate(filters, start=1):
            layers.append(keras.layers.Conv2D(f, 3, padding="same", activation="relu",
                                              name=f"conv{b}_{c}"))
        if height // 2 >= 2 and width // 2 >= 2:
            layers.append(keras.layers.MaxPooling2D(name=f"pool{b}"))
            height, width = height // 2, width // 2
    layers += [keras.layers.Flatten(name="flatten"),
               keras.layers.Dense(fc_units, activation="relu", name="fc1"),
               keras.layers.Dense(fc_units, activation="relu", name="fc2"),
               keras.layers.Dense(num_classes, name="logits")]
    return keras.Sequential(layers, name="vgg_fc")


def head_fraction(model: keras.Model) -> float:
    """Fraction of trainable parameters after the ``flatten`` layer.

    Args:
      model: A model built by :func:`vgg_fc`.

    Returns:
      Parameters of ``fc1``, ``fc2`` and ``logits`` over all trainable parameters.
    """
    names = [layer.name for layer in model.layers]
    head = model.layers[names.index("flatten") + 1:]
    head_params = sum(layer.count_params() for layer in head)
    total = sum(int(v.numpy().size) for v in model.trainable_variables)
    return head_params / total
