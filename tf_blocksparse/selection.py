"""Block scoring and top-k block selection (TensorFlow, graph friendly, static shapes).

All functions work on a variable's block view ``[outer, num_blocks, inner]`` (see
:mod:`tf_blocksparse.blocks`), obtained by a free reshape.  Nothing sorts or copies the
full tensor: scoring is one reduction, selection runs ``top_k`` (``argmax`` for k=1) on the
``[num_blocks]`` score vector, and gathering reads only the selected blocks.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tf_blocksparse import kernels
from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.options import METRICS


def num_selected(num_blocks: int, k: int | None = None, density: float | None = None) -> int:
    """Number of blocks to keep for a variable with ``num_blocks`` blocks.

    Args:
      num_blocks: Blocks of the variable (0 for an empty variable).
      k: Fixed count; clipped to ``num_blocks``.
      density: Fraction in (0, 1]; ``ceil(density * num_blocks)``, at least 1.

    Returns:
      An int in ``[1, num_blocks]`` (0 for an empty variable).
    """
    if density is not None:
        n = math.ceil(density * num_blocks)
    else:
        n = 1 if k is None else k
    return min(num_blocks, max(1, n))


def view(x: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """Reshapes ``x`` [*shape] to its block view [outer, num_blocks, inner]."""
    return tf.reshape(x, layout.view_shape)


def block_scores(x: tf.Tensor, layout: BlockLayout, metric: str = "l1") -> tf.Tensor:
    """Scores every block of ``x`` [*shape] by its L1 or L2 norm, in one pass.

    Filter / unit blocks (``inner == 1``) are columns of an ``[outer, num_blocks]`` view;
    their L1 norms are a ones-vector product (a GEMV, faster on CPU than a column reduction),
    their L2 norms one fused ``EuclideanNorm``.  Row blocks reduce along rows; element blocks
    are their own absolute values.

    On CPU, float32/64 tensors are scored by one fused pass instead
    (:func:`tf_blocksparse.kernels.block_scores`; equal up to float summation order).

    Returns:
      [num_blocks] scores, float32 for half-precision inputs, else ``x.dtype``.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if isinstance(x, tf.Tensor) and kernels.fusable(x):
        return kernels.block_scores(x, layout, metric)
    outer, nb, inner = layout.view_shape
    if x.dtype.is_floating and x.dtype.size < 4:
        x = tf.cast(x, tf.float32)
    if outer == 1 and inner == 1:
        return tf.abs(tf.reshape(x, (nb,)))
    if inner == 1:
        v = tf.reshape(x, (outer, nb))
        if metric == "l1":
            return tf.reshape(tf.matmul(tf.ones((1, outer), x.dtype), tf.abs(v)), (nb,))
        return tf.math.reduce_euclidean_norm(v, axis=0)
    v, axis = (tf.reshape(x, (nb, inner)), 1) if outer == 1 else (view(x, layout), (0, 2))
    if metric == "l1":
        return tf.reduce_sum(tf.abs(v), axis=axis)
    return tf.math.reduce_euclidean_norm(v, axis=axis)


def top_blocks(scores: tf.Tensor, k: int) -> tf.Tensor:
    """Ids of the ``k`` highest scores; ties go to the lower id.

    Args:
      scores: [num_blocks] float scores.
      k: Static number of blocks, ``1 <= k <= num_blocks``.

    Returns:
      [k] int32 block ids.
    """
    if k == 1:
        return tf.reshape(tf.argmax(scores, output_type=tf.int32), (1,))
    return tf.math.top_k(scores, k=k, sorted=False).indices


def _block_offsets(layout: BlockLayout) -> np.ndarray:
    """Flat offsets of block 0's elements, in C order of (outer, inner) [outer * inner]."""
    _, nb, inner = layout.view_shape
    o = np.arange(layout.outer, dtype=np.int64)[:, None] * (nb * inner)
    return (o + np.arange(inner, dtype=np.int64)[None, :]).reshape(-1)


def block_flat_indices(ids: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """Flat indices into ``x`` [*shape] of every element of the blocks ``ids`` [k].

    Block ``b``'s elements sit at ``offsets + b * inner`` where ``offsets`` (a graph constant)
    are block 0's; no index grid is built at run time.

    Returns:
      [k, block_size] int32 (int64 for tensors of 2**31 elements or more).
    """
    dtype = tf.int64 if layout.size >= 2**31 else tf.int32
    ids = tf.cast(ids, dtype)
    if layout.block_size == 1:
        return ids[:, None]
    offsets = tf.constant(_block_offsets(layout), dtype)
    return ids[:, None] * layout.inner + offsets[None, :]


def gather_blocks(x: tf.Tensor, layout: BlockLayout, ids: tf.Tensor,
                  flat_indices: tf.Tensor | None = None) -> tf.Tensor:
    """Gathers the selected blocks of ``x`` [*shape] as contiguous rows.

    Args:
      x: The tensor.
      layout: Its layout.
      ids: [k] int32 block ids.
      flat_indices: Optionally, ``block_flat_indices(ids, layout)`` already computed.

    Returns:
      [k, block_size] values; row i is block ``ids[i]`` in C order of ``(outer, inner)``.
    """
    if layout.outer == 1:  # rows are already contiguous
        return tf.gather(tf.reshape(x, (layout.num_blocks, layout.inner)), ids)
    if flat_indices is None:
        flat_indices = block_flat_indices(ids, layout)
    return tf.gather(tf.reshape(x, (-1,)), flat_indices)


def scatter_blocks(values: tf.Tensor, ids: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """Sums block rows back into a dense tensor (repeated ids add up).

    Args:
      values: [m, block_size] block values.
      ids: [m] int32 block ids (may repeat, e.g. when gathered from several replicas).
      layout: Layout of the destination variable.

    Returns:
      [*shape] dense tensor, zero outside the given blocks.
    """
    outer, nb, inner = layout.view_shape
    dense = tf.math.unsorted_segment_sum(values, ids, nb)  # [nb, outer * inner]
    if outer > 1:
        dense = tf.transpose(tf.reshape(dense, (nb, outer, inner)), (1, 0, 2))
    return tf.reshape(dense, layout.shape)


def blocks_hit(ids: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """[num_blocks] bool: true at the block ids ``ids`` [k]."""
    return tf.math.unsorted_segment_max(tf.ones_like(ids), ids, layout.num_blocks) > 0


def zero_blocks_where(x: tf.Tensor, layout: BlockLayout, zero: tf.Tensor) -> tf.Tensor:
    """Returns ``x`` [*shape] with every block where ``zero`` [num_blocks] bool is true set
    to zero (others bit-exact)."""
    keep = tf.reshape(tf.logical_not(zero), (1, layout.num_blocks, 1))
    return tf.reshape(tf.where(keep, view(x, layout), tf.zeros((), x.dtype)), layout.shape)


def zero_blocks(x: tf.Tensor, layout: BlockLayout, ids: tf.Tensor,
                flat_indices: tf.Tensor | None = None) -> tf.Tensor:
    """Returns ``x`` [*shape] with the blocks ``ids`` [k] set to zero (others bit-exact).

    Few blocks are zeroed by a scatter of ``k * block_size`` entries, which reuses ``x``'s
    buffer when nothing else holds it; past a quarter of the blocks a broadcast ``where`` is
    cheaper.  ``flat_indices`` may pass :func:`block_flat_indices` already computed.
    """
    if 4 * ids.shape[0] > layout.num_blocks:
        return zero_blocks_where(x, layout, blocks_hit(ids, layout))
    if flat_indices is None:
        flat_indices = block_flat_indices(ids, layout)
    idx = tf.reshape(flat_indices, (-1, 1))
    zeros = tf.zeros((idx.shape[0],), x.dtype)
    return tf.reshape(tf.tensor_scatter_nd_update(tf.reshape(x, (-1,)), idx, zeros),
                      layout.shape)
