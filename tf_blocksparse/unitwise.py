"""Unit-wise norms and NFNets' Adaptive Gradient Clipping.

A *unit* is the slice of a variable that AGC rescales as a whole.  NFNets' rule (Brock et al.
2021): a scalar or vector is one unit; a dense kernel ``(in, out)`` has one unit per output
(norm over axis 0); a convolution kernel (``(kw, cin, cout)`` for Conv1D, ``(kh, kw, cin,
cout)`` for Conv2D, ...: output filters last) one per output filter (norm over every axis but
the last).  That default is all shape can tell.  Layers whose output axes are elsewhere
(``Conv2DTranspose`` kernels ``(kh, kw, filters, in)``: filters on axis -2; ``EinsumDense``
multi-axis outputs; depthwise kernels) need their layout: ``unit_axes`` names the axes that
index the units explicitly, and :func:`layout_unit_axes` reads them off the block-rule table
(:mod:`tf_blocksparse.blocks`), so that inside ``BlockSparseOptimizer`` AGC's units of a
rank >= 2 variable are exactly its blocks.  Vectors and scalars stay one unit, as NFNets
defines (the table's per-element blocks of a bias are a selection granularity, not an AGC unit).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_blocksparse.blocks import BlockLayout

__all__ = ["adaptive_clip", "default_unit_axes", "layout_unit_axes", "unitwise_norm"]

_TINY = 1e-6


def default_unit_axes(rank: int) -> tuple[int, ...]:
    """NFNets' unit axes by rank: none (rank <= 1), ``(1,)`` (rank 2), ``(rank - 1,)``.

    Args:
        rank: The variable's rank.

    Returns:
        The axes that index the units (the norm is taken over the others).
    """
    if rank <= 1:
        return ()
    return (rank - 1,)


def layout_unit_axes(layout: BlockLayout) -> tuple[int, ...] | None:
    """AGC unit axes equal to the blocks of ``layout`` (``None`` for rank <= 1: whole).

    Args:
        layout: A variable's block layout from the block-rule table.

    Returns:
        The axes ``[start, stop)`` that index the layout's blocks, or ``None``.
    """
    rank = len(layout.shape)
    if rank <= 1:
        return None
    start, stop = layout.rule.span(rank)
    return tuple(range(start, stop))


def _check_unit_axes(unit_axes: Sequence[int], rank: int) -> tuple[int, ...]:
    axes = []
    for a in unit_axes:
        if isinstance(a, bool) or int(a) != a or not -rank <= a < rank:
            raise ValueError(f"`unit_axes` must be axes of a rank-{rank} tensor, "
                             f"got {tuple(unit_axes)!r}")
        axes.append(int(a) % rank)
    if len(set(axes)) != len(axes):
        raise ValueError(f"`unit_axes` has a repeated axis: {tuple(unit_axes)!r}")
    return tuple(axes)


def unitwise_norm(x: tf.Tensor, unit_axes: Sequence[int] | None = None) -> tf.Tensor:
    """Unit-wise L2 norm, broadcastable to ``x``.

    Args:
        x: Tensor [*shape].
        unit_axes: Axes that index the units (kept); the norm runs over the other axes.
            ``None``: :func:`default_unit_axes` (whole for rank <= 1, per output unit of a
            dense kernel, per output filter (last axis) for rank >= 3).

    Returns:
        Norms [*shape with every non-unit axis 1], e.g. [1, out] for a dense kernel and
        [1, 1, cout] for a Conv1D kernel.
    """
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    keep = default_unit_axes(rank) if unit_axes is None else _check_unit_axes(unit_axes, rank)
    axes = [a for a in range(rank) if a not in keep]
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))


def adaptive_clip(grad: tf.Tensor, param: tf.Tensor, clip_factor: float = 0.01,
                  eps: float = 1e-3, unit_axes: Sequence[int] | None = None) -> tf.Tensor:
    """Adaptive Gradient Clipping (Brock et al. 2021, NFNets), unit-wise.

    ``g_unit *= min(1, clip_factor * max(||w_unit||, eps) / max(||g_unit||, 1e-6))``.

    Args:
        grad: Gradient [*shape].
        param: The variable's value [*shape].
        clip_factor: lambda (> 0).
        eps: Floor of the weight norm (>= 0).
        unit_axes: Optional axes that index the units (see :func:`unitwise_norm`).

    Returns:
        The clipped gradient [*shape].
    """
    if not clip_factor > 0:
        raise ValueError(f"`clip_factor` must be > 0, got {clip_factor!r}")
    if not eps >= 0:
        raise ValueError(f"`eps` must be >= 0, got {eps!r}")
    grad = tf.convert_to_tensor(grad)
    param = tf.cast(tf.convert_to_tensor(param), grad.dtype)
    if grad.shape != param.shape:
        raise ValueError(f"`grad` shape {grad.shape} != `param` shape {param.shape}")
    w_norm = tf.maximum(unitwise_norm(param, unit_axes), eps)
    g_norm = tf.maximum(unitwise_norm(grad, unit_axes), _TINY)
    return grad * tf.minimum(1.0, clip_factor * w_norm / g_norm)
