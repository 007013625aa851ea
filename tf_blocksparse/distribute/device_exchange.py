"""The project's exchange over a device list, for the adapters that see every replica at once
(:class:`~tf_blocksparse.distribute.cross_device_ops.BlockSparseCrossDeviceOps` and the hybrid
trainer's :class:`~tf_blocksparse.distribute.hybrid_sync.GroupSync`): one call of
:func:`tf_blocksparse.exchange.run` over :class:`~tf_blocksparse.collectives.DeviceCollectives`,
the residual variables committed, and a dense fallback for non-finite steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_blocksparse.collectives import DeviceCollectives
from tf_blocksparse.exchange import run
from tf_blocksparse.feedback import BlockTopK

__all__ = ["run_on_devices"]


def run_on_devices(devices: Sequence[str], mode: str, comp: BlockTopK,
                   grads: Sequence[Sequence[tf.Tensor]],
                   residuals: Sequence[Sequence[tf.Variable]]) -> list[tf.Tensor]:
    """One exchange step over a device list, committing the residuals.

    When any replica's accumulated gradient holds an inf or NaN, the residuals stay as they
    were and the dense sum of ``grads`` is returned instead (non-finite, so a loss-scaling
    optimizer downstream skips the step).

    Args:
      devices: One device per replica; the sums are formed on ``devices[0]``.
      mode: ``"allgather"`` or ``"shared"``.
      comp: The compressor over the variables.
      grads: ``grads[r][v]``: replica ``r``'s gradient [*shape_v].
      residuals: ``residuals[r][v]``: replica ``r``'s residual variable [*shape_v].

    Returns:
      Per variable the summed update [*shape_v] on ``devices[0]``.
    """
    comm = DeviceCollectives(devices)
    state = []
    for r, per_var in enumerate(residuals):
        with comm.local(r):
            state.append([v.read_value() for v in per_var])
    results = run(comm, mode, comp, grads, state)
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
