"""In-group gradient sync of the hybrid conv/FC runtime.

The replicas of a group are :class:`~tf_blocksparse.runtime.replica.Replica`\\ s of a model
part (the conv trunk or the FC head), each variable copy on the device the placement gives its
layer (the replica's compute device, or the host device for layers in "expanded" memory).

:class:`GroupSync` sums one group's per-replica gradients **variable by variable**: the sum of
variable ``v`` depends only on the replicas' gradients of ``v``, so it can start as soon as
those are ready (during the rest of the backward pass).  Dense: one sum on the group's first
compute device.  Block-sparse: the project's one exchange over the replicas' devices
(the exchange hook of :mod:`tf_blocksparse.hooks`, one bucket per variable, as in
:class:`~tf_blocksparse.distribute.cross_device_ops.BlockSparseCrossDeviceOps`), per variable:
error feedback ``acc = grad + residual``, the top-k blocks of ``acc`` by L1/L2 score (a Dense
kernel's block is one output unit's incoming weights, a conv kernel's one filter), ``residual =
acc`` with those blocks zeroed, and the sum of every replica's selected blocks; when a
replica's ``acc`` holds an inf/NaN the residuals stay unchanged and the dense sum is used.  The
result is copied to every replica's variable device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_blocksparse import blocks
from tf_blocksparse.distribute.device_exchange import exchange_on_devices, sum_on_devices
from tf_blocksparse.exchange_bytes import selection_nbytes
from tf_blocksparse.feedback import BlockTopK, compressor_for
from tf_blocksparse.options import CompressionOptions
from tf_blocksparse.runtime.devices import device_key
from tf_blocksparse.runtime.replica import Replica
from tf_blocksparse.runtime.slicing import split_sizes

__all__ = ["GroupSync", "ancestors", "check_compression", "check_devices",
           "gradient_dependencies", "replica_report", "row_sizes", "variable_bytes"]


def check_compression(spec: Mapping[str, Any] | CompressionOptions | None, arg: str
                      ) -> CompressionOptions | None:
    """A group's compression as the one options object; ``None`` means dense.

    The dict form ``{"k" | "density", "metric"}`` (the launchers') is converted here, once:
    every variable compressed (``dense_below=0``) with ``"allgather"``.

    Args:
        spec: ``None``, a :class:`~tf_blocksparse.options.CompressionOptions`, or a dict.
        arg: The argument's name, for errors.

    Returns:
        ``None`` or the :class:`~tf_blocksparse.options.CompressionOptions`.

    Raises:
        ValueError: Unknown keys, bad ``k`` / ``density`` or ``metric`` (naming ``arg``).
    """
    if spec is None or isinstance(spec, CompressionOptions):
        return spec
    if not isinstance(spec, Mapping) or set(spec) - {"k", "density", "metric"}:
        raise ValueError(f"{arg} must be None, a tfbs.CompressionOptions or a dict with keys "
                         f"k, density, metric; got {spec!r}")
    try:
        return CompressionOptions(k=spec.get("k"), density=spec.get("density"),
                                  metric=spec.get("metric", "l1"), exchange="allgather",
                                  dense_below=0)
    except ValueError as err:
        raise ValueError(f"{arg}: {err}") from err


def check_devices(devices: Any, arg: str) -> list[str]:
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"{arg} must be a non-empty sequence of device names, got {devices!r}")
    known = {device_key(d.name) for d in tf.config.list_logical_devices()}
    out = []
    for d in devices:
        try:
            spec = tf.DeviceSpec.from_string(d) if isinstance(d, str) else None
        except ValueError:
            spec = None
        if spec is None or spec.device_type is None:
            raise ValueError(f"{arg}: {d!r} is not a device name like '/cpu:0' or '/gpu:0'")
        if device_key(d) not in known:
            raise ValueError(f"{arg}: device {d!r} does not exist; logical devices: "
                             f"{sorted(d.name for d in tf.config.list_logical_devices())}")
        out.append(d)
    return out


def ancestors(op: tf.Operation) -> set[str]:
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        if cur.name in seen:
            continue
        seen.add(cur.name)
        stack.extend(t.op for t in cur.inputs)
        stack.extend(cur.control_inputs)
    return seen


def gradient_dependencies(grads: Sequence[Sequence[tf.Tensor]], totals: Sequence[tf.Tensor],
                          paths: Sequence[str]) -> dict[str, list[str]]:
    """For every variable, the other variables whose gradients its sum depends on.

    Args:
        grads: ``grads[r][v]``: replica ``r``'s gradient of variable ``v`` (graph tensors).
        totals: ``totals[v]``: the sum of variable ``v`` in the same graph.
        paths: Variable names.

    Returns:
        ``{paths[v]: [paths[u] for u != v whose gradient ops are ancestors of totals[v]]}``.
    """
    grad_ops = [{g[v].op.name for g in grads} for v in range(len(paths))]
    out = {}
    for v, total in enumerate(totals):
        anc = ancestors(total.op)
        out[paths[v]] = [paths[u] for u in range(len(paths)) if u != v and grad_ops[u] & anc]
    return out


def row_sizes(batch: int, conv_replicas: int, fc_replicas: int) -> dict[str, list[int]]:
    """Rows per replica of a ``batch``-row mini-batch: ``{"conv": [...], "fc": [...]}``.

    The batch is cut into ``conv_replicas`` consecutive slices (sizes differ by at most one).
    With ``I >= J`` A replica ``i`` sends its rows to B replica ``floor(i * J / I)``, so B
    replica ``j`` holds the rows of its A replicas; with ``I < J`` the batch is cut into ``J``
    slices.

    Raises:
        ValueError: ``batch`` is not an int at least the replica count of each group.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) \
            or batch < max(conv_replicas, fc_replicas):
        raise ValueError(f"x: the batch size {batch!r} must be static and at least the replica "
                         f"count of each group ({conv_replicas} conv, {fc_replicas} fc)")
    conv = split_sizes(batch, conv_replicas)
    if conv_replicas >= fc_replicas:
        fc = [0] * fc_replicas
        for i, rows in enumerate(conv):
            fc[i * fc_replicas // conv_replicas] += rows
    else:
        fc = split_sizes(batch, fc_replicas)
    return {"conv": conv, "fc": fc}


def _device(var: Any) -> str:
    return var.value.device if isinstance(var, keras.Variable) else var.device


def replica_report(rep: Replica, optimizers: Sequence[keras.optimizers.Optimizer],
                   residuals: Sequence[tf.Variable]) -> dict[str, Any]:
    """The compute device and the device of every variable a replica owns, by path."""
    return {
        "compute_device": rep.device,
        "variables": {ref.path: _device(var)
                      for ref, var in zip(rep.trainable_refs, rep.trainable)},
        "optimizer_slots": {v.path: _device(v) for opt in optimizers for v in opt.variables},
        "residuals": {ref.path: _device(res) for ref, res in zip(rep.trainable_refs, residuals)},
    }


def variable_bytes(rep: Replica, optimizers: Sequence[keras.optimizers.Optimizer],
                   residuals: Sequence[tf.Variable]) -> list[tuple[str, int]]:
    """``(device, bytes)`` of every variable a replica owns (copies, slots, residuals)."""
    owned = [*rep.trainable, *rep.non_trainable,
             *(v for opt in optimizers for v in opt.variables), *residuals]
    return [(_device(v), math.prod(int(d) for d in v.shape) * tf.as_dtype(v.dtype).size)
            for v in owned]


class GroupSync:
    """Variable-by-variable gradient sum over one group's replicas (module docstring).

    Every variable is its own fusion bucket, exchanged by the project's exchange hooks
    (:func:`~tf_blocksparse.hooks.dense_hook` or :func:`~tf_blocksparse.hooks.block_sparse_hook`
    through :mod:`~tf_blocksparse.distribute.device_exchange`), so its sum depends on no
    other variable's gradients.

    Args:
        replicas: The group's replicas (same variables, in the same order).
        model: The original model (gives the block rule of each variable's layer).
        compression: ``None`` (dense) or a :class:`~tf_blocksparse.options.CompressionOptions`
            (the launchers' dict form converts by :func:`check_compression`).
        name: Group name (``"conv"`` / ``"fc"``), used in op and variable names.

    Attributes:
        compression: The options given, or ``None``.
        options: The :class:`~tf_blocksparse.options.CompressionOptions` applied, or
            ``None`` when the group sums densely.

    Raises:
        ValueError: ``exchange="auto"`` or ``dense_steps`` (the optimizer wrapper's alone).
    """

    def __init__(self, replicas: Sequence[Replica], model: keras.Model,
                 compression: CompressionOptions | None, name: str) -> None:
        self.replicas = list(replicas)
        self.name = name
        options = self.compression = check_compression(compression, "compression")
        if options is not None and options.auto:
            raise ValueError(f"`compression` of group {name!r}: exchange='auto' (the "
                             "CompressionOptions default) is only supported by "
                             "BlockSparseOptimizer; choose 'allgather', 'shared' or 'dense'")
        if options is not None and options.dense_steps:
            raise ValueError(f"`compression` of group {name!r}: dense_steps="
                             f"{options.dense_steps} is only supported by "
                             "BlockSparseOptimizer (it counts the steps); use 0")
        self.options = options if options is not None and options.sparse else None
        refs = self.replicas[0].trainable_refs
        self.layouts = blocks.layouts_for(refs, model,
                                          self.options.rules if self.options else None)
        self.compressors: list[BlockTopK] = []
        self.residuals: list[list[tf.Variable]] = []
        if self.options is not None:
            self.compressors = [compressor_for(self.options, [lay]) for lay in self.layouts]
            for r, rep in enumerate(self.replicas):
                per_var = []
                for i, (var, dev) in enumerate(zip(rep.trainable, rep.var_devices)):
                    with tf.device(dev):
                        per_var.append(tf.Variable(tf.zeros(var.shape, var.dtype),
                                                   trainable=False,
                                                   name=f"{name}_residual_{i}_replica_{r}"))
                self.residuals.append(per_var)

    def nbytes(self) -> dict[str, int]:
        """Bytes one replica contributes per step: ``{"dense": ..., "payload": ...}``."""
        dtypes = [r.dtype for r in self.replicas[0].trainable_refs]
        dense = sum(lay.size * tf.as_dtype(dt).size for lay, dt in zip(self.layouts, dtypes))
        if not self.compressors:
            return {"dense": dense, "payload": dense}
        return {"dense": dense, "payload": sum(selection_nbytes(c, [dt]) for c, dt
                                               in zip(self.compressors, dtypes))}

    def reduce(self, grads: Sequence[Sequence[tf.Tensor]]) -> tuple[list, list]:
        """Sums ``grads[r][v]`` over replicas ``r`` for every variable ``v``.

        Each variable is one bucket of its own: dense, one sum on the group's first compute
        device (:func:`~tf_blocksparse.distribute.device_exchange.sum_on_devices`);
        block-sparse, the project's exchange with its own non-finite fallback
        (:func:`~tf_blocksparse.distribute.device_exchange.exchange_on_devices`).

        Returns:
            ``(totals, per_replica)``: ``totals[v]`` the sum [*shape_v] on the group's first
            compute device; ``per_replica[r][v]`` its copy on replica ``r``'s variable device.
        """
        devices = [rep.device for rep in self.replicas]
        totals = []
        for v in range(len(self.layouts)):
            with tf.name_scope(f"{self.name}_allreduce_{v}"):
                column = [[g[v]] for g in grads]
                if not self.compressors:
                    totals.append(sum_on_devices(devices, column)[0])
                else:
                    totals.append(exchange_on_devices(
                        devices, self.options.exchange,
                        lambda bucket, c=self.compressors[v]: c, column,
                        [[res[v]] for res in self.residuals])[0])
        per_replica = []
        for rep in self.replicas:
            copies = []
            for total, dev in zip(totals, rep.var_devices):
                with tf.device(dev):
                    copies.append(tf.identity(total))
            per_replica.append(copies)
        return totals, per_replica
