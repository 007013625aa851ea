"""The baseline the local clipping rules of :mod:`tf_blocksparse.clipping` are measured
against: a plain Keras optimizer that clips the global norm of its *all-reduced*
gradients (the central clipping that layer-wise local clipping replaces).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_blocksparse import _compat

__all__ = ["clip_after_all_reduce"]


def clip_after_all_reduce(optimizer: Any, clip_norm: float) -> None:
    """Makes a plain Keras optimizer clip the global norm of its *all-reduced* gradients.

    The baseline the local rules are measured against: Keras' own ``clipnorm`` /
    ``global_clipnorm`` clip each replica's local gradients before its cross-replica sum;
    after this call the optimizer clips the sum instead (``tf.clip_by_global_norm`` over
    the variables with a gradient), so every replica applies the same clipped aggregate.
    Needs the central all-reduce it hooks, so it is no rule of ``BlockSparseOptimizer``.

    Args:
      optimizer: A Keras optimizer (not a ``BlockSparseOptimizer``, whose exchange replaces
        Keras' all-reduce), changed in place.
      clip_norm: The global-norm threshold (> 0).

    Raises:
      ValueError: ``clip_norm`` is not > 0.
      RuntimeError: The installed Keras has no all-reduce to hook (an untested version).
    """
    if not float(clip_norm) > 0:
        raise ValueError(f"`clip_norm` must be > 0, got {clip_norm!r}")
    threshold = float(clip_norm)

    def clip(pairs: list) -> list:
        kept = [i for i, (g, _) in enumerate(pairs) if g is not None]
        clipped, _ = tf.clip_by_global_norm([pairs[i][0] for i in kept], threshold)
        for i, g in zip(kept, clipped):
            pairs[i] = (g, pairs[i][1])
        return pairs

    _compat.after_gradient_all_reduce(optimizer, clip)
