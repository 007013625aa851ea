"""Wire encodings for sparse gradients (block-index, packed buffers) and bytes.

Standalone: depends on numpy and TensorFlow only.  (The run-length codec the notebooks
compare against is :mod:`tf_blocksparse.extras.run_length`.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

INT32_BYTES = 4


def require_int_vector(name: str, arr: np.ndarray) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``arr`` is a 1-D integer array."""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {arr.shape}")


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
        require_int_vector("ids", self.ids)
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
    require_int_vector("ids", ids)
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
    return INT32_BYTES * int(p.ids.size) + int(p.values.nbytes)


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
