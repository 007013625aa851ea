"""What each exchange mode puts on the wire, from the buffers' static shapes and dtypes.

:mod:`tf_blocksparse.exchange` builds the buffers; these functions count them without running
anything, for the metrics (``payload_bytes``), the automatic exchange's cost model and the
hybrid group sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_blocksparse import codec, quantize
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.planning.exchange_cost import GroupCost

__all__ = ["dense_nbytes", "group_cost", "selection_nbytes"]


def dense_nbytes(tensors: Sequence[tf.Tensor]) -> int:
    """Bytes of a dense exchange of ``tensors`` (static)."""
    return sum(codec.buffer_nbytes(t) for t in tensors)


def selection_nbytes(comp: BlockTopK, dtypes: Sequence[Any]) -> int:
    """Bytes of what one replica selects per step: an int32 id per kept block of each
    compressed variable and the values of every kept block (a variable sent whole: all its
    values, no ids; a compressor that keeps every block: the dense bytes)."""
    def values(lay: Any, n: int, whole: bool, dt: Any) -> int:
        mode = "none" if whole or comp.keeps_all else comp.quantize
        return quantize.value_nbytes(n, lay.block_size, mode, tf.as_dtype(dt).size)

    return sum((0 if whole or comp.keeps_all else 4 * n) + values(lay, n, whole, dt)
               for lay, n, whole, dt in zip(comp.layouts, comp.counts, comp.whole, dtypes))


def group_cost(comp: BlockTopK, dtypes: Sequence[Any], compress_s: float = 0.0) -> GroupCost:
    """The bytes one replica hands to each mode's collectives for ``comp``'s variables
    (static, the buffers :func:`run` builds), with a measured compression time."""
    sizes = [tf.as_dtype(dt).size for dt in dtypes]
    whole_flags = [True] * len(sizes) if comp.keeps_all else comp.whole  # run as dense
    whole = sum(lay.size * it for lay, w, it in zip(comp.layouts, whole_flags, sizes) if w)
    parts = [(n, lay, it) for lay, n, w, it in zip(comp.layouts, comp.counts, whole_flags, sizes)
             if not w]
    return GroupCost(
        dense_bytes=sum(lay.size * it for lay, it in zip(comp.layouts, sizes)),
        whole_bytes=whole,
        id_bytes=4 * (sum(n for n, _, _ in parts) + 1) if parts else 0,
        value_bytes=sum(quantize.value_nbytes(n, lay.block_size, comp.quantize, it)
                        for n, lay, it in parts),
        score_bytes=4 * sum(lay.num_blocks for _, lay, _ in parts),
        compress_s=compress_s,
        recurrent_bytes=sum(lay.size * it for _, lay, it in parts if lay.recurrent))
