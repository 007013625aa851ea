"""The two ways replicas' buffers meet: collectives in replica context, or a device list.

The exchange (:mod:`tf_blocksparse.exchange`) is written once against this small interface.
A call handles the *local* replicas' buffers (one per local replica) and gets back the
combined buffer, identical for every replica:

:class:`ReplicaCollectives`
    Inside ``strategy.run`` / ``model.fit``: each replica runs the exchange for itself (one
    local replica); ``gather`` is ``ReplicaContext.all_gather``, ``sum`` is ``all_reduce``.
:class:`DeviceCollectives`
    Where one call sees every replica's values (a ``CrossDeviceOps``, the hybrid trainer's
    group sync): one local replica per device; the per-replica work runs on its device and
    the buffers are stacked or added on the reduce device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import tensorflow as tf

_SUM = tf.distribute.ReduceOp.SUM


class ReplicaCollectives:
    """This replica's side of the strategy's collectives (one local replica).

    Args:
      ctx: The replica context (the default one works without a strategy).
    """

    def __init__(self, ctx: tf.distribute.ReplicaContext):
        self.ctx = ctx
        self.devices: tuple[str | None, ...] = (None,)

    @property
    def num_replicas(self) -> int:
        """Replicas in sync (all of them, not only the local ones)."""
        return self.ctx.num_replicas_in_sync

    @contextlib.contextmanager
    def local(self, replica: int) -> Iterator[None]:
        """Where local replica ``replica``'s own work runs (the current device)."""
        yield

    @contextlib.contextmanager
    def combine(self) -> Iterator[None]:
        """Where work on a combined buffer runs (the current device)."""
        yield

    def gather(self, bufs: Sequence[tf.Tensor]) -> tf.Tensor:
        """Every replica's 1-D buffer [n] stacked: [num_replicas, n]."""
        (buf,) = bufs
        return tf.reshape(self.ctx.all_gather(buf, axis=0), (self.num_replicas, -1))

    def sum(self, bufs: Sequence[tf.Tensor]) -> tf.Tensor:
        """The sum of every replica's buffer [*shape]."""
        (buf,) = bufs
        return self.ctx.all_reduce(_SUM, buf)

    def sum_each(self, tensors: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        """Per position ``i``, the sum over replicas of ``tensors[replica][i]`` (one call)."""
        (mine,) = tensors
        return self.ctx.all_reduce(_SUM, list(mine))


class DeviceCollectives:
    """Replicas given as a device list, combined on ``reduce_device``.

    Args:
      devices: One device per replica (local replica ``r`` works on ``devices[r]``).
      reduce_device: Where the buffers are combined; default ``devices[0]``.
    """

    def __init__(self, devices: Sequence[str], reduce_device: str | None = None):
        if not devices:
            raise ValueError("`devices` must name at least one device")
        self.devices = tuple(devices)
        self.reduce_device = reduce_device or self.devices[0]

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    def local(self, replica: int) -> contextlib.AbstractContextManager:
        return tf.device(self.devices[replica])

    def combine(self) -> contextlib.AbstractContextManager:
        return tf.device(self.reduce_device)

    def gather(self, bufs: Sequence[tf.Tensor]) -> tf.Tensor:
        with self.combine():
            return tf.stack(list(bufs))

    def sum(self, bufs: Sequence[tf.Tensor]) -> tf.Tensor:
        with self.combine():
            return bufs[0] if len(bufs) == 1 else tf.add_n(list(bufs))

    def sum_each(self, tensors: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        """One packed sum: each replica's tensors flattened into one buffer on its device
        (when they share a dtype), summed, and cut back [*shape_i]; element-wise the same
        bits as a sum per tensor."""
        first = list(tensors[0])
        if len(first) < 2 or len({t.dtype for t in first}) != 1:
            return [self.sum(column) for column in zip(*tensors)]
        bufs = []
        for r, mine in enumerate(tensors):
            with self.local(r):
                bufs.append(tf.concat([tf.reshape(t, [-1]) for t in mine], 0))
        summed = self.sum(bufs)
        with self.combine():
            sizes = [t.shape.num_elements() for t in first]
            return [tf.reshape(piece, t.shape) for piece, t in zip(tf.split(summed, sizes), first)]
