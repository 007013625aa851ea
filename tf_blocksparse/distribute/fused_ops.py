"""``FusedCrossDeviceOps``: deprecated name of the dense, bucketed
:class:`~tf_blocksparse.distribute.cross_device_ops.BlockSparseCrossDeviceOps`.

``FusedCrossDeviceOps(plan=p)`` is ``BlockSparseCrossDeviceOps(fusion=p)`` and
``FusedCrossDeviceOps(buffer_bytes=b, model=m)`` is ``BlockSparseCrossDeviceOps(fusion=b,
model=m)``: the dense sum in balanced fusion buckets, bit-identical to the default
one-device reduction.
"""

from __future__ import annotations

import warnings
from typing import Any

from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.fusion import FusionPlan

__all__ = ["FusedCrossDeviceOps"]


def FusedCrossDeviceOps(plan: FusionPlan | None = None,  # noqa: N802 - the old class name
                        buffer_bytes: int | None = None,
                        model: Any = None) -> BlockSparseCrossDeviceOps:
    """Deprecated: ``BlockSparseCrossDeviceOps(fusion=plan or buffer_bytes, model=model)``.

    Args:
      plan: A :class:`FusionPlan` over the gradient batch (indices = positions in the batch).
      buffer_bytes: Alternatively, the fusion buffer size in bytes.
      model: Optional Keras model whose gradients are reduced.

    Returns:
      The dense, bucketed ``BlockSparseCrossDeviceOps``.

    Raises:
      ValueError: Not exactly one of ``plan`` and ``buffer_bytes``, or a bad one.
    """
    warnings.warn("FusedCrossDeviceOps is deprecated: use "
                  "tfbs.BlockSparseCrossDeviceOps(fusion=plan_or_buffer_bytes), which also "
                  "composes fusion with compression", DeprecationWarning, stacklevel=2)
    if (plan is None) == (buffer_bytes is None):
        raise ValueError("give exactly one of `plan` and `buffer_bytes`")
    if buffer_bytes is not None and (isinstance(buffer_bytes, bool)
                                     or not isinstance(buffer_bytes, int) or buffer_bytes < 1):
        raise ValueError(f"`buffer_bytes` must be an int >= 1, got {buffer_bytes!r}")
    return BlockSparseCrossDeviceOps(fusion=plan if plan is not None else buffer_bytes,
                                     model=model)
