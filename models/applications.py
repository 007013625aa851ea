"""ImageNet-sized networks of ``keras.applications`` with random weights (nothing is
downloaded): the variable sets of the fusion, selection and scaling benchmarks."""

from __future__ import annotations

from collections.abc import Callable

import keras


def _application(builder: Callable[..., keras.Model], input_shape: tuple[int, int, int],
                 num_classes: int, seed: int | None) -> keras.Model:
    if seed is not None:
        keras.utils.set_random_seed(seed)
    return builder(weights=None, input_shape=tuple(input_shape), classes=num_classes,
                   classifier_activation=None)


def resnet50(input_shape: tuple[int, int, int] = (224, 224, 3), num_classes: int = 1000,
             seed: int | None = None) -> keras.Model:
    """``keras.applications.ResNet50`` (~25.6M parameters at 1000 classes).

    Args:
      input_shape: ``(height, width, 3)``, at least 32x32.
      num_classes: Output logits.
      seed: Optional seed for the initialisers.

    Returns:
      An uncompiled model producing logits [batch, num_classes].
    """
    return _application(keras.applications.ResNet50, input_shape, num_classes, seed)


def resnet101(input_shape: tuple[int, int, int] = (224, 224, 3), num_classes: int = 1000,
              seed: int | None = None) -> keras.Model:
    """``keras.applications.ResNet101`` (~44.7M parameters); arguments as :func:`resnet50`."""
    return _application(keras.applications.ResNet101, input_shape, num_classes, seed)


def vgg16(input_shape: tuple[int, int, int] = (224, 224, 3), num_classes: int = 1000,
          seed: int | None = None) -> keras.Model:
    """``keras.applications.VGG16`` (~138M parameters); arguments as :func:`resnet50`."""
    return _application(keras.applications.VGG16, input_shape, num_classes, seed)
