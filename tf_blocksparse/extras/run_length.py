"""Run-length encoding of sparse tensors, in NumPy and in TensorFlow.

Not part of the exchange (which sends blocks, :mod:`tf_blocksparse.codec`): the
``compression_anatomy`` notebook compares the sizes a run-length codec makes of the same
updates.  Standalone: depends on numpy and TensorFlow only.  NaN counts as non-zero (data).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from tf_blocksparse.codec import INT32_BYTES, require_int_vector

__all__ = ["RLEPayload", "rle_decode", "rle_decode_tf", "rle_encode", "rle_encode_tf",
           "rle_nbytes"]

@dataclasses.dataclass(frozen=True, eq=False)
class RLEPayload:
    """Run-length encoding of a tensor whose zero runs are dropped.

    Attributes:
        length: Number of elements n of the flattened tensor.
        shape: Original shape of the tensor (``prod(shape) == length``).
        starts: int64 [r] start offset of each non-zero run, strictly increasing.
        lengths: int64 [r] length (>= 1) of each run.
        values: [sum(lengths)] concatenated run values, dtype of the source tensor.
    """

    length: int
    shape: tuple[int, ...]
    starts: np.ndarray
    lengths: np.ndarray
    values: np.ndarray

    def validate(self) -> None:
        """Checks the payload is well formed.

        Raises:
            ValueError: If a field is malformed; the message names the field.
        """
        if int(self.length) < 0:
            raise ValueError(f"`length` must be >= 0, got {self.length}")
        if math.prod(self.shape) != self.length:
            raise ValueError(f"`length` {self.length} != prod(`shape`) for shape {self.shape}")
        require_int_vector("starts", self.starts)
        require_int_vector("lengths", self.lengths)
        if self.starts.shape != self.lengths.shape:
            raise ValueError(
                f"`starts` shape {self.starts.shape} != `lengths` shape {self.lengths.shape}"
            )
        if self.lengths.size and self.lengths.min() < 1:
            raise ValueError("`lengths` entries must be >= 1")
        if self.starts.size:
            starts = self.starts.astype(np.int64)
            ends = starts + self.lengths.astype(np.int64)
            if starts[0] < 0 or starts[-1] >= self.length:
                raise ValueError(f"`starts` entries must lie in [0, {self.length})")
            if np.any(np.diff(starts) <= 0):
                raise ValueError("`starts` must be strictly increasing")
            if np.any(ends[:-1] > starts[1:]):
                raise ValueError("`starts`/`lengths` describe overlapping runs")
            if ends[-1] > self.length:
                raise ValueError(f"`lengths`: last run ends past length {self.length}")
        total = int(self.lengths.sum()) if self.lengths.size else 0
        if self.values.ndim != 1 or self.values.shape[0] != total:
            raise ValueError(
                f"`values` must have shape ({total},) = (sum(lengths),), got {self.values.shape}"
            )


def rle_encode(x: np.ndarray) -> RLEPayload:
    """Run-length encodes a tensor (flattened in C order).

    Args:
        x: Array of any shape [*shape]; zeros are dropped, NaN counts as non-zero.

    Returns:
        The payload; ``values`` keeps the dtype of ``x``.
    """
    x = np.asarray(x)
    flat = x.reshape(-1)
    nonzero = (flat != 0) | np.isnan(flat) if np.issubdtype(flat.dtype, np.inexact) else flat != 0
    edges = np.diff(np.concatenate(([0], nonzero.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1).astype(np.int64)
    ends = np.flatnonzero(edges == -1).astype(np.int64)
    return RLEPayload(
        length=int(flat.size),
        shape=tuple(int(d) for d in x.shape),
        starts=starts,
        lengths=ends - starts,
        values=flat[nonzero].copy(),
    )


def rle_decode(p: RLEPayload) -> np.ndarray:
    """Decodes a payload (validated first) to [*p.shape]; zeros outside the runs.

    Raises:
        ValueError: If the payload is malformed.
    """
    p.validate()
    out = np.zeros(p.length, dtype=p.values.dtype)
    lengths = p.lengths.astype(np.int64)
    offsets = np.cumsum(lengths) - lengths  # position of each run within `values`
    index = np.repeat(p.starts.astype(np.int64) - offsets, lengths) + np.arange(p.values.size)
    out[index] = p.values
    return out.reshape(p.shape)


def rle_nbytes(p: RLEPayload) -> int:
    """Wire bytes: 4-byte length header + int32 starts and lengths + values."""
    return INT32_BYTES + INT32_BYTES * (p.starts.size + p.lengths.size) + int(p.values.nbytes)


def rle_encode_tf(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """TF twin of :func:`rle_encode` for 1-D tensors; usable inside ``tf.function``.

    Args:
        x: Float tensor [n] (other shapes are flattened in C order).

    Returns:
        ``(starts [r] int32, lengths [r] int32, values [m])`` with ``m = sum(lengths)``.
    """
    x = tf.reshape(tf.convert_to_tensor(x), [-1])
    # Compare bit patterns, not values: TF on CPU flushes subnormals to zero in float
    # comparisons, but a subnormal is data.  Only +0.0 and -0.0 count as zero.
    bits = {2: tf.int16, 4: tf.int32, 8: tf.int64}.get(x.dtype.size) if x.dtype.is_floating \
        else None
    if bits is None:
        nonzero = tf.not_equal(x, tf.zeros_like(x))
    else:
        magnitude = tf.bitwise.bitwise_and(tf.bitcast(x, bits), tf.constant(
            (1 << (8 * x.dtype.size - 1)) - 1, bits))  # sign bit cleared
        nonzero = tf.not_equal(magnitude, tf.zeros_like(magnitude))
    padded = tf.pad(tf.cast(nonzero, tf.int32), [[1, 1]])
    edges = padded[1:] - padded[:-1]
    starts = tf.cast(tf.reshape(tf.where(tf.equal(edges, 1)), [-1]), tf.int32)
    ends = tf.cast(tf.reshape(tf.where(tf.equal(edges, -1)), [-1]), tf.int32)
    return starts, ends - starts, tf.boolean_mask(x, nonzero)


def rle_decode_tf(
    starts: tf.Tensor, lengths: tf.Tensor, values: tf.Tensor, length: int | tf.Tensor
) -> tf.Tensor:
    """TF twin of :func:`rle_decode` (no validation); usable inside ``tf.function``.

    Args:
        starts: int32 [r] run starts.
        lengths: int32 [r] run lengths.
        values: [m] concatenated run values.
        length: Output length n.

    Returns:
        Tensor [n] with dtype of ``values``.
    """
    starts = tf.cast(starts, tf.int32)
    lengths = tf.cast(lengths, tf.int32)
    offsets = tf.cumsum(lengths, exclusive=True)
    index = tf.repeat(starts - offsets, lengths) + tf.range(tf.shape(values)[0])
    shape = tf.reshape(tf.cast(length, tf.int32), [1])
    # An update, not an add: copies bits, so subnormals survive TF's flush-to-zero.
    return tf.tensor_scatter_nd_update(tf.zeros(shape, values.dtype), index[:, None], values)
