"""Quantised block values: what the all-gather exchange sends of each selected block.

A selected block's values ``[k, block_size]`` are sent as codes of ``bits`` bits packed into
int32 words (so they ride in the exchange's one int32 buffer with the block ids: one
collective, and a dtype every collective implementation takes):

``"bfloat16"``
    The values rounded to bfloat16 (16 bits, no scale).
``"int8"`` / ``"int4"``
    Per block a float32 scale ``max |v| / q`` (``q`` = 127 or 7; at least the smallest normal
    float32, since CPU kernels flush subnormals to zero) and per value the integer
    ``round(v / scale)`` in ``[-q, q]``: the error per value is at most ``scale / 2``.

:func:`encode` returns the dequantised values as well: the exchange keeps ``acc - sent`` as
the residual, so the quantisation error is fed back like the unsent blocks (nothing lost).

Bytes per block and variable: ``4`` per scale (int8/int4) and ``ceil(k * block_size * bits
/ 32) * 4`` for the codes.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_blocksparse.options import QUANTIZATIONS

__all__ = ["QUANTIZATIONS", "decode", "encode", "num_words", "value_nbytes"]

_BITS = {"bfloat16": 16, "int8": 8, "int4": 4}
_LEVELS = {"int8": 127, "int4": 7}
#: The smallest normal float32: the least scale (a subnormal one would be flushed to zero).
_FLT_MIN = 1.1754943508222875e-38


def _code_words(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


def num_words(k: int, block_size: int, mode: str) -> int:
    """Int32 words :func:`encode` gives for ``k`` blocks of ``block_size`` values."""
    scales = k if mode in _LEVELS else 0
    return scales + _code_words(k * block_size, _BITS[mode])


def value_nbytes(k: int, block_size: int, mode: str, itemsize: int) -> int:
    """Bytes one replica sends for the values of ``k`` blocks (``mode="none"``: the values'
    own ``itemsize``)."""
    if mode == "none":
        return k * block_size * itemsize
    return 4 * num_words(k, block_size, mode)


def _pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Unsigned ``bits``-bit codes [n] (int64) packed into int32 words [ceil(n bits / 32)]."""
    per_word = 32 // bits
    n = int(codes.shape[0])
    words = _code_words(n, bits)
    codes = tf.pad(codes, [[0, words * per_word - n]])
    shifts = tf.constant([bits * j for j in range(per_word)], tf.int64)
    packed = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(codes, (words, per_word)), shifts),
                           axis=1)  # < 2**32: the bits are disjoint
    return tf.cast(tf.where(packed >= 2**31, packed - 2**32, packed), tf.int32)


def _unpack(words: tf.Tensor, bits: int, n: int) -> tf.Tensor:
    """Inverse of :func:`_pack` on each row: words [R, w] int32 -> codes [R, n] int64."""
    per_word = 32 // bits
    w = tf.cast(words, tf.int64)
    w = tf.where(w < 0, w + 2**32, w)
    shifts = tf.constant([bits * j for j in range(per_word)], tf.int64)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(w[:, :, None], shifts), 2**bits - 1)
    return tf.reshape(codes, (tf.shape(words)[0], -1))[:, :n]


def encode(values: tf.Tensor, mode: str) -> tuple[tf.Tensor, tf.Tensor]:
    """Quantises block values.

    Args:
      values: [k, block_size] float values of the selected blocks.
      mode: One of :data:`QUANTIZATIONS` but ``"none"``.

    Returns:
      ``(words, sent)``: int32 words [num_words(k, block_size, mode)] (the scales' bits,
      then the packed codes), and the values they decode to [k, block_size] in
      ``values``' dtype.
    """
    v = tf.cast(values, tf.float32)
    if mode == "bfloat16":
        q = tf.cast(v, tf.bfloat16)
        codes = tf.cast(tf.bitcast(tf.reshape(q, (-1,)), tf.uint16), tf.int64)
        return _pack(codes, 16), tf.cast(tf.cast(q, tf.float32), values.dtype)
    levels = _LEVELS[mode]
    top = tf.reduce_max(tf.abs(v), axis=1)  # [k]
    # never a subnormal scale: TensorFlow's CPU kernels flush those to zero (0 / 0 = NaN);
    # a block under levels * FLT_MIN is coded in steps of FLT_MIN (error <= FLT_MIN / 2)
    tiny = tf.constant(_FLT_MIN, tf.float32)
    scale = tf.where(top > 0, tf.maximum(top / levels, tiny), tf.ones_like(top))
    q = tf.clip_by_value(tf.round(v / scale[:, None]), -levels, levels)
    sent = q * scale[:, None]
    codes = tf.cast(tf.reshape(q, (-1,)), tf.int64) + (levels + 1)  # unsigned
    words = tf.concat([tf.bitcast(scale, tf.int32), _pack(codes, _BITS[mode])], 0)
    return words, tf.cast(sent, values.dtype)


def decode(words: tf.Tensor, k: int, block_size: int, mode: str) -> tf.Tensor:
    """The values of every row's blocks.

    Args:
      words: [R, num_words(k, block_size, mode)] int32, one row per sending replica.
      k: Blocks per row.
      block_size: Values per block.
      mode: As given to :func:`encode`.

    Returns:
      [R * k, block_size] float32 values, row-major over (replica, block).
    """
    n = k * block_size
    if mode == "bfloat16":
        codes = tf.cast(_unpack(words, 16, n), tf.uint16)
        q = tf.bitcast(codes, tf.bfloat16)
        return tf.reshape(tf.cast(q, tf.float32), (-1, block_size))
    levels = _LEVELS[mode]
    scale = tf.bitcast(words[:, :k], tf.float32)  # [R, k]
    q = tf.cast(_unpack(words[:, k:], _BITS[mode], n) - (levels + 1), tf.float32)
    values = tf.reshape(q, (-1, k, block_size)) * scale[:, :, None]
    return tf.reshape(values, (-1, block_size))
