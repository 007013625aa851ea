"""Model registry: the one place a network gets its name.

Every launch script builds its models here, so a name means one network everywhere.  Image
models take ``(input_shape, num_classes)`` and output logits.  The sequence models
``gru_nmt`` and ``lstm_nmt`` reuse the same signature: ``input_shape = (src_vocab,)`` and
``num_classes = tgt_vocab``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import keras


def _builder(module: str, function: str) -> Callable[..., keras.Model]:
    """``models.<module>.<function>``, imported at its first call.

    The registry itself imports no Keras (nor TensorFlow), so the launch scripts' flags
    (``--model``'s choices) and ``--help`` load in well under a second.
    """

    def build(*args: Any, **kwargs: Any) -> keras.Model:
        return getattr(importlib.import_module(f"models.{module}"), function)(*args, **kwargs)

    build.__name__ = build.__qualname__ = function
    build.__doc__ = f"Builds :func:`models.{module}.{function}` (imported at the call)."
    return build


MODELS: dict[str, Callable[..., keras.Model]] = {
    "resnet20": _builder("resnet", "resnet20"),
    "vgg_fc": _builder("vgg", "vgg_fc"),
    "cnn_small": _builder("cnn", "cnn_small"),
    "gru_nmt": _builder("nmt", "gru_nmt"),
    "lstm_nmt": _builder("nmt", "lstm_nmt"),
    "cnn_bn": _builder("cnn", "cnn_bn"),
    "resnet50": _builder("applications", "resnet50"),
    "resnet101": _builder("applications", "resnet101"),
    "vgg16": _builder("applications", "vgg16"),
}
SEQUENCE_MODELS = frozenset({"gru_nmt", "lstm_nmt"})
#: Models that train on the launch data sets (28x28 Fashion-MNIST, 8x8 digits, ...).
DATASET_MODELS = ("resnet20", "vgg_fc", "cnn_small", "cnn_bn", "gru_nmt", "lstm_nmt")
#: ``keras.applications`` networks built for ImageNet-sized inputs by default.
IMAGENET_MODELS = ("resnet50", "resnet101", "vgg16")


def default_input(name: str) -> tuple[tuple[int, ...], int]:
    """``(input_shape, num_classes)`` a benchmark builds ``name`` with when not told.

    ImageNet networks: 224x224x3, 1000 classes; the small image models: 32x32x3, 10.

    Raises:
      ValueError: ``name`` is not a registered image model.
    """
    if name not in MODELS or is_sequence_model(name):
        raise ValueError(f"unknown image model {name!r}; choose from "
                         f"{sorted(set(MODELS) - SEQUENCE_MODELS)}")
    return ((224, 224, 3), 1000) if name in IMAGENET_MODELS else ((32, 32, 3), 10)


def is_sequence_model(name: str) -> bool:
    """Whether ``name`` is a sequence-to-sequence model (token inputs, [N, T, V] logits)."""
    return name in SEQUENCE_MODELS


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                seed: int | None = None, **kwargs: Any) -> keras.Model:
    """Builds a registered model.

    Args:
      name: A key of :data:`MODELS`.
      input_shape: Image models: ``(height, width, channels)``.  ``gru_nmt``: ``(src_vocab,)``.
      num_classes: Image models: number of logits.  ``gru_nmt``: the target vocabulary size.
      seed: Optional initialiser seed.
      **kwargs: Extra builder arguments (e.g. ``fc_units`` for ``vgg_fc``, ``units`` for
        ``gru_nmt``).

    Returns:
      The uncompiled model: logits [batch, num_classes], or [batch, T, tgt_vocab] for
      ``gru_nmt`` (inputs ``[enc_in [batch, S], dec_in [batch, T]]``).

    Raises:
      ValueError: ``name`` is not registered.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    if is_sequence_model(name):
        (src_vocab,) = tuple(input_shape)
        return MODELS[name](src_vocab=src_vocab, tgt_vocab=num_classes, seed=seed, **kwargs)
    return MODELS[name](input_shape=tuple(input_shape), num_classes=num_classes, seed=seed,
                        **kwargs)


def build_image_model(name: str, image_size: int | None = None, num_classes: int | None = None,
                      seed: int | None = None) -> keras.Model:
    """Builds a registered image model on square RGB inputs, as the benchmarks use them.

    Args:
      name: A key of :data:`MODELS` (not a sequence model).
      image_size: Input height and width; ``None``: the model's :func:`default_input`.
      num_classes: Output logits; ``None``: the model's :func:`default_input`.
      seed: Optional initialiser seed.

    Returns:
      The uncompiled model: images [batch, image_size, image_size, 3] to logits
      [batch, num_classes].

    Raises:
      ValueError: ``name`` is not a registered image model.
    """
    shape, classes = default_input(name)
    if image_size is not None:
        shape = (image_size, image_size, 3)
    return build_model(name, shape, classes if num_classes is None else num_classes, seed=seed)
