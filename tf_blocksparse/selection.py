"""Block scoring and top-k block selection (TensorFlow, graph friendly, static shapes).

All functions work on a variable's block view ``[outer, num_blocks, inner]`` (see
:mod:`tf_blocksparse.blocks`), obtained by a free reshape.  Nothing sorts or copies the
full tensor: scoring is one reduction, selection runs ``top_k`` (``argmax`` for k=1) on the
``[num_blocks]`` score vector, and gathering reads only the selected blocks.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_blocksparse.blocks import BlockLayout

METRICS = ("l1", "l2")


def num_selected(num_blocks: int, k: int | None = None, density: float | None = None) -> int:
    """Number of blocks to keep for a variable with ``num_blocks`` blocks.

    Args:
      num_blocks: Blocks of the variable (>= 1).
      k: Fixed count; clipped to ``num_blocks``.
      density: Fraction in (0, 1]; ``ceil(density * num_blocks)``, at least 1.

    Returns:
      An int in ``[1, num_blocks]``.
    """
    if density is not None:
        n = math.ceil(density * num_blocks)
    else:
        n = 1 if k is None else k
    return max(1, min(num_blocks, n))


def view(x: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """Reshapes ``x`` [*shape] to its block view [outer, num_blocks, inner]."""
    return tf.reshape(x, layout.view_shape)


def block_scores(x: tf.Tensor, layout: BlockLayout, metric: str = "l1") -> tf.Tensor:
    """Scores every block of ``x`` [*shape] by its L1 or L2 norm.

    Returns:
      [num_blocks] scores, float32 (computed in float32 for half-precision inputs).
    """
    outer, nb, inner = layout.view_shape
    if x.dtype != tf.float32 and x.dtype.is_floating and x.dtype.size < 4:
        x = tf.cast(x, tf.float32)
    if inner == 1:
        v, axis = tf.reshape(x, (outer, nb)), 0
    elif outer == 1:
        v, axis = tf.reshape(x, (nb, inner)), 1
    else:
        v, axis = tf.reshape(x, (outer, nb, inner)), (0, 2)
    if metric == "l1":
        return tf.reduce_sum(tf.abs(v), axis=axis)
    if metric == "l2":
        return tf.math.reduce_euclidean_norm(v, axis=axis)
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


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


def gather_blocks(x: tf.Tensor, layout: BlockLayout, ids: tf.Tensor) -> tf.Tensor:
    """Gathers the selected blocks of ``x`` [*shape] as contiguous rows.

    Returns:
      [k, block_size] values; row i is block ``ids[i]`` in C order of ``(outer, inner)``.
    """
    outer, nb, inner = layout.view_shape
    k = ids.shape[0]
    if outer == 1:
        return tf.gather(tf.reshape(x, (nb, inner)), ids)
    if inner == 1:
        return tf.transpose(tf.gather(tf.reshape(x, (outer, nb)), ids, axis=1))
    g = tf.gather(tf.reshape(x, (outer, nb, inner)), ids, axis=1)
    return tf.reshape(tf.transpose(g, (1, 0, 2)), (k, outer * inner))


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


def block_element_indices(ids: tf.Tensor, layout: BlockLayout) -> tf.Tensor:
    """Indices into the view [outer, num_blocks, inner] of every element of the given blocks.

    Returns:
      [k * outer * inner, 3] int32 indices, usable with ``tensor_scatter_nd_update`` on the
      view (to zero or restore the selected blocks without touching the rest).
    """
    outer, _, inner = layout.view_shape
    k = ids.shape[0]
    o = tf.range(outer, dtype=tf.int32)[:, None, None] + tf.zeros((1, k, inner), tf.int32)
    b = ids[None, :, None] + tf.zeros((outer, 1, inner), tf.int32)
    i = tf.range(inner, dtype=tf.int32)[None, None, :] + tf.zeros((outer, k, 1), tf.int32)
    return tf.reshape(tf.stack([o, b, i], axis=-1), (-1, 3))


def zero_blocks(x: tf.Tensor, layout: BlockLayout, ids: tf.Tensor) -> tf.Tensor:
    """Returns ``x`` [*shape] with the blocks ``ids`` [k] set to zero (others bit-exact).

    Few blocks are zeroed with an in-place-capable scatter of ``k * block_size`` entries;
    when more than a quarter of the blocks are selected a broadcast ``where`` is cheaper.
    """
    if 4 * ids.shape[0] > layout.num_blocks:
        hit = tf.math.unsorted_segment_max(tf.ones_like(ids), ids, layout.num_blocks) > 0
        keep = tf.reshape(tf.logical_not(hit), (1, layout.num_blocks, 1))
        return tf.reshape(tf.where(keep, view(x, layout), tf.zeros((), x.dtype)), layout.shape)
    idx = block_element_indices(ids, layout)
    zeros = tf.zeros((idx.shape[0],), x.dtype)
    return tf.reshape(tf.tensor_scatter_nd_update(view(x, layout), idx, zeros), layout.shape)
