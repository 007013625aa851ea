"""The optimizer of a ``launch.train`` run: ``BlockSparseOptimizer(SGD)`` as its
:class:`~launch.method.Method` says, and the learning rate (constant or a cosine schedule).

Keras and the library are imported inside the functions, so importing this module (as
``launch.train --help`` does) loads no TensorFlow.
"""

from __future__ import annotations

from typing import Any

from launch.method import Method


def learning_rate(lr: float, schedule: str = "constant", total_steps: int = 0,
                  warmup_steps: int = 0) -> Any:
    """``lr`` as ``schedule`` asks: the float itself, or a Keras ``CosineDecay`` that warms
    up linearly from 0 to ``lr`` over ``warmup_steps`` and then decays to 0 at
    ``total_steps`` (optimizer steps, all epochs together).

    Raises:
      ValueError: ``schedule`` unknown, or a cosine schedule without ``total_steps >
        warmup_steps``.
    """
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"`schedule` must be 'constant' or 'cosine', got {schedule!r}")
    if total_steps <= warmup_steps:
        raise ValueError(f"`total_steps` ({total_steps}) must exceed `warmup_steps` "
                         f"({warmup_steps}) for a cosine schedule")
    import keras

    if not warmup_steps:
        return keras.optimizers.schedules.CosineDecay(lr, total_steps, alpha=0.0)
    return keras.optimizers.schedules.CosineDecay(
        0.0, total_steps - warmup_steps, alpha=0.0, warmup_target=lr, warmup_steps=warmup_steps)


def wrapper_arguments(method: Method) -> dict[str, Any]:
    """The keyword arguments of ``BlockSparseOptimizer`` besides the inner optimizer and
    the options, for ``method``: those it leaves at their defaults are left out, so the
    library's defaults apply.

    ``global_momentum`` keeps the momentum in the inner SGD, after the exchange (the
    literal form); by default the sparse methods move it before the exchange (DGC
    correction).  With local steps the inner SGD keeps its momentum on each worker, and
    ``outer_lr`` replaces the library's outer optimizer with a (Nesterov) SGD.
    """
    import keras

    extra: dict[str, Any] = {}
    if method.fusion_buffer_bytes:
        extra["fusion_buffer_bytes"] = method.fusion_buffer_bytes
    if method.sync_every:
        extra["sync_every"] = method.sync_every
        if method.outer_lr is not None:
            momentum = method.outer_momentum or 0.0
            extra["outer"] = keras.optimizers.SGD(method.outer_lr, momentum=momentum,
                                                  nesterov=momentum > 0)
    if not method.options.sparse:
        return extra
    if method.global_momentum and not method.sync_every:
        extra["momentum_correction"] = None
    if method.whole_momentum is not None:
        import tf_blocksparse as tfbs

        extra["momentum_correction"] = tfbs.MomentumCorrection(
            masking=method.momentum_masking or "auto", whole_momentum=method.whole_momentum)
    elif method.momentum_masking is not None:
        extra["momentum_masking"] = method.momentum_masking
    return extra


def make_optimizer(method: Method, lr: Any, momentum: float) -> Any:
    """``BlockSparseOptimizer(SGD(lr, momentum), method.options, ...)``.

    Args:
      method: The exchange method.
      lr: The learning rate: a float or a Keras schedule (:func:`learning_rate`).
      momentum: The SGD momentum, in [0, 1].
    """
    import keras

    import tf_blocksparse as tfbs

    inner = keras.optimizers.SGD(lr, momentum=momentum)
    return tfbs.BlockSparseOptimizer(inner, method.options, **wrapper_arguments(method))
