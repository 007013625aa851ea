"""The project's exchange over a device list, for the adapters that see every replica at once
(:class:`~tf_blocksparse.distribute.cross_device_ops.BlockSparseCrossDeviceOps` and the hybrid
trainer's :class:`~tf_blocksparse.hybrid.sync.GroupSync`): the bucketed exchange
hook (:func:`tf_blocksparse.hooks.exchange_buckets` with
:func:`~tf_blocksparse.hooks.block_sparse_hook`) over
:class:`~tf_blocksparse.collectives.DeviceCollectives`, the residual variables committed, and
a dense fallback for non-finite steps; and :func:`sum_on_devices`, the dense hook there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_blocksparse import hooks
from tf_blocksparse.blocks import BlockLayout
from tf_blocksparse.collectives import DeviceCollectives
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.fusion import FusionPlan

__all__ = ["exchange_on_devices", "run_on_devices", "sum_on_devices"]


def sum_on_devices(devices: Sequence[str], grads: Sequence[Sequence[tf.Tensor]],
                   groups: FusionPlan | Sequence[Sequence[int]] | None = None
                   ) -> list[tf.Tensor]:
    """The dense sum over a device list, one packed sum per bucket
    (:func:`~tf_blocksparse.hooks.dense_hook`).

    Args:
      devices: One device per replica; the sums are formed on ``devices[0]``.
      grads: ``grads[r][v]``: replica ``r``'s gradient [*shape_v].
      groups: The buckets (a fusion plan or positions per group), or ``None`` for one.

    Returns:
      Per variable the sum [*shape_v] on ``devices[0]``, element-wise the same bits as the
      default one-device reduction.
    """
    state = hooks.HookState(DeviceCollectives(devices), "dense")
    buckets = hooks.buckets_for(grads, groups)
    return list(hooks.exchange_buckets(hooks.dense_hook, state, buckets)[0].updates)


def exchange_on_devices(devices: Sequence[str], mode: str,
                        compressor: Callable[[hooks.Bucket], BlockTopK],
                        grads: Sequence[Sequence[tf.Tensor]],
                        residuals: Sequence[Sequence[tf.Variable]],
                        groups: FusionPlan | Sequence[Sequence[int]] | None = None,
                        layouts: Sequence[BlockLayout] = ()) -> list[tf.Tensor]:
    """One bucketed exchange step over a device list, committing the residuals.

    When any replica's accumulated gradient (in any bucket) holds an inf or NaN, every
    residual stays as it was and the dense sum of ``grads`` is returned instead (non-finite,
    so a loss-scaling optimizer downstream skips the step).

    Args:
      devices: One device per replica; the sums are formed on ``devices[0]``.
      mode: ``"allgather"`` or ``"shared"``.
      compressor: Builds a bucket's compressor.
      grads: ``grads[r][v]``: replica ``r``'s gradient [*shape_v].
      residuals: ``residuals[r][v]``: replica ``r``'s residual variable [*shape_v].
      groups: The buckets (a fusion plan or positions per group), or ``None`` for one.
      layouts: Per variable its layout (handed to ``compressor`` in the buckets), or empty.

    Returns:
      Per variable the summed update [*shape_v] on ``devices[0]``.
    """
    comm = DeviceCollectives(devices)
    state = []
    for r, per_var in enumerate(residuals):
        with comm.local(r):
            state.append([v.read_value() for v in per_var])
    hook_state = hooks.HookState(comm, mode, compressor, state)
    buckets = hooks.buckets_for(grads, groups, layouts)
    results = hooks.exchange_buckets(hooks.block_sparse_hook, hook_state, buckets)
    finite = results[0].finite
    for r, (per_var, res) in enumerate(zip(residuals, results)):
        with comm.local(r):
            for var, new in zip(per_var, res.residuals):
                var.assign(tf.where(finite, new, var.read_value()))
    out = []
    with comm.combine():
        for v, update in enumerate(results[0].updates):
            column = [g[v] for g in grads]
            out.append(tf.cond(finite, lambda u=update: u,
                               lambda c=column: tf.add_n([tf.identity(t) for t in c])))
    return out


def run_on_devices(devices: Sequence[str], mode: str, comp: BlockTopK,
                   grads: Sequence[Sequence[tf.Tensor]],
                   residuals: Sequence[Sequence[tf.Variable]]) -> list[tf.Tensor]:
    """:func:`exchange_on_devices` with one bucket of every variable and compressor
    ``comp`` over them."""
    return exchange_on_devices(devices, mode, lambda bucket: comp, grads, residuals)
