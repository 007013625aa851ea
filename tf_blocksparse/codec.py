"""Wire encodings for sparse gradients (run-length, block-index, packed buffers) and bytes.

Standalone: depends on numpy and TensorFlow only. In RLE, NaN counts as non-zero (data).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

_INT32_BYTES = 4


def _require_int(name: str, arr: np.ndarray) -> None:
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {arr.shape}")


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
        _require_int("starts", self.starts)
        _require_int("lengths", self.lengths)
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
    return _INT32_BYTES + _INT32_BYTES * (p.starts.size + p.lengths.size) + int(p.values.nbytes)


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


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPayload:
    """Selected contiguous blocks of a gradient.

    Attributes:
        num_blocks: Total number of blocks of the source tensor.
        block_size: Elements per block.
        ids: int32 [k] distinct block ids in [0, num_blocks).
        values: [k, block_size] the rows of the selected blocks.
    """

    num_blocks: int
    block_size: int
    ids: np.ndarray
    values: np.ndarray

    def validate(self) -> None:
        """Checks the payload is well formed.

        Raises:
            ValueError: If a field is malformed; the message names the field.
        """
        if int(self.num_blocks) < 0:
            raise ValueError(f"`num_blocks` must be >= 0, got {self.num_blocks}")
        if int(self.block_size) < 0:
            raise ValueError(f"`block_size` must be >= 0, got {self.block_size}")
        _require_int("ids", self.ids)
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.num_blocks):
            raise ValueError(f"`ids` entries must lie in [0, {self.num_blocks})")
        if np.unique(self.ids).size != self.ids.size:
            raise ValueError("`ids` must be distinct")
        expected = (self.ids.size, self.block_size)
        if self.values.shape != expected:
            raise ValueError(f"`values` shape {self.values.shape} != {expected}")


def block_encode(blocks: np.ndarray, ids: Any) -> BlockPayload:
    """Gathers the selected rows of a block matrix.

    Args:
        blocks: [num_blocks, block_size] the gradient split into blocks.
        ids: [k] distinct integer block ids.

    Returns:
        The payload with int32 ``ids`` and ``values`` [k, block_size].

    Raises:
        ValueError: If ``blocks`` is not 2-D or ``ids`` is malformed.
    """
    blocks = np.asarray(blocks)
    if blocks.ndim != 2:
        raise ValueError(f"`blocks` must be 2-D [num_blocks, block_size], got {blocks.shape}")
    ids = np.asarray(ids)
    _require_int("ids", ids)
    num_blocks, block_size = blocks.shape
    probe = BlockPayload(num_blocks, block_size, ids, np.empty((ids.size, block_size)))
    probe.validate()
    return BlockPayload(num_blocks, block_size, ids.astype(np.int32), blocks[ids].copy())


def block_decode(p: BlockPayload) -> np.ndarray:
    """Scatters the blocks back; [num_blocks, block_size] with zeros elsewhere."""
    p.validate()
    out = np.zeros((p.num_blocks, p.block_size), dtype=p.values.dtype)
    out[p.ids] = p.values
    return out


def block_nbytes(p: BlockPayload) -> int:
    """Wire bytes: int32 ids plus the value matrix."""
    return _INT32_BYTES * int(p.ids.size) + int(p.values.nbytes)


def dense_nbytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (numpy or TF dtype)."""
    itemsize = dtype.size if isinstance(dtype, tf.DType) else np.dtype(dtype).itemsize
    return math.prod(int(d) for d in shape) * int(itemsize)


def _sizes(shapes: Sequence[tuple[int, ...]]) -> list[int]:
    return [math.prod(int(d) for d in s) for s in shapes]


def pack(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Flattens and concatenates tensors into one buffer [sum of sizes].

    Raises:
        ValueError: If ``tensors`` is empty or mixes dtypes.
    """
    if not tensors:
        raise ValueError("`tensors` must be non-empty")
    flat = [tf.reshape(t, [-1]) for t in tensors]
    if len({t.dtype for t in flat}) != 1:
        raise ValueError(f"`tensors` must share one dtype, got {[t.dtype for t in flat]}")
    return flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)


def unpack(buffer: tf.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[tf.Tensor]:
    """Splits a buffer [n] into tensors of the given static shapes.

    Raises:
        ValueError: At trace time if ``buffer`` is not 1-D or its static length is not
            the sum of the sizes of ``shapes``.
    """
    buffer = tf.convert_to_tensor(buffer)
    sizes = _sizes(shapes)
    if buffer.shape.rank != 1:
        raise ValueError(f"`buffer` must be 1-D, got shape {buffer.shape}")
    n = buffer.shape[0]
    if n is not None and n != sum(sizes):
        raise ValueError(f"`buffer` length {n} != sum of sizes {sum(sizes)} of `shapes`")
    if len(sizes) == 1:
        return [tf.reshape(buffer, shapes[0])]
    parts = tf.split(buffer, sizes) if sizes else []
    return [tf.reshape(t, s) for t, s in zip(parts, shapes)]


def buffer_nbytes(t: tf.Tensor) -> int:
    """Static bytes of a tensor handed to a collective.

    Raises:
        ValueError: If the shape of ``t`` is not fully defined.
    """
    if not t.shape.is_fully_defined():
        raise ValueError(f"`t` shape {t.shape} is not fully defined")
    return int(t.shape.num_elements()) * int(t.dtype.size)


def pack_np(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Numpy twin of :func:`pack`."""
    if not arrays:
        raise ValueError("`arrays` must be non-empty")
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def unpack_np(buffer: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Numpy twin of :func:`unpack`."""
    buffer = np.asarray(buffer)
    sizes = _sizes(shapes)
    if buffer.ndim != 1 or buffer.size != sum(sizes):
        raise ValueError(f"`buffer` shape {buffer.shape} != ({sum(sizes)},) for `shapes`")
    bounds = np.cumsum([0, *sizes])
    return [buffer[a:b].reshape(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes)]
