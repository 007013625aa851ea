"""Model registry: names to builders.

Image models take ``(input_shape, num_classes)``.  The sequence model ``gru_nmt`` reuses the
same signature: ``input_shape = (src_vocab,)`` and ``num_classes = tgt_vocab``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from models.cnn import cnn_small
from models.nmt import gru_nmt
from models.resnet import resnet20
from models.vgg import vgg_fc

MODELS: dict[str, Callable[..., keras.Model]] = {
    "resnet20": resnet20,
    "vgg_fc": vgg_fc,
    "cnn_small": cnn_small,
    "gru_nmt": gru_nmt,
}
SEQUENCE_MODELS = frozenset({"gru_nmt"})


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
