"""The pieces of ``launch.train_hybrid`` around the trainer: the groups' devices (logical
CPUs on one host, or the workers of an emulated cluster), the global batches, the
data-parallel reference the hybrid run is checked against, and placement summaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from absl import app

from launch import runtime


def parse_workers(text: str) -> tuple[int, int] | None:
    """``"I+J"`` -> ``(I, J)``; ``None`` when malformed or a count is < 1."""
    parts = str(text).split("+")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    i, j = (int(p) for p in parts)
    return (i, j) if i >= 1 and j >= 1 else None


def cluster_devices(conv: int, fc: int, fc_state_task: int) -> dict[str, Any]:
    """Connects to the emulated cluster: conv replicas on tasks ``0..I-1``, FC replicas on
    ``I..I+J-1``, the FC state on ``fc_state_task`` (-1: task ``I``); the data-parallel
    reference on ``I`` logical CPUs of this client (made before connecting)."""

    from tf_blocksparse.runtime import remote

    runtime.logical_cpus(conv)
    workers = remote.connect(remote.cluster_from_env())
    if len(workers) != conv + fc:
        raise ValueError(f"the cluster has {len(workers)} workers, --workers asks for "
                         f"{conv}+{fc}")
    task = conv if fc_state_task < 0 else fc_state_task
    if task >= conv + fc:
        raise app.UsageError(f"--fc_state_task={fc_state_task} is not a worker task "
                             f"(0..{conv + fc - 1})")
    return {"conv": workers[:conv], "fc": workers[conv:], "host": workers[task],
            "reference": [f"/job:chief/replica:0/task:0/device:CPU:{i}" for i in range(conv)],
            "fc_state_task": task}


def hybrid_devices(conv_replicas: int, fc_replicas: int, host_device: str = ""
                   ) -> dict[str, Any]:
    """Device names for the groups (configures logical CPUs on a CPU host; call first).

    Returns:
        ``{"conv": [...], "fc": [...], "host": str, "reference": [...]}`` (``reference``: the
        distinct devices of the data-parallel reference).
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        n = len(gpus)
        conv = [f"/gpu:{i % n}" for i in range(conv_replicas)]
        fc = [f"/gpu:{(conv_replicas + j) % n}" for j in range(fc_replicas)]
        return {"conv": conv, "fc": fc, "host": host_device or "/cpu:0",
                "reference": sorted(set(conv))}
    total = conv_replicas + fc_replicas + 1
    runtime.logical_cpus(total)
    conv = [f"/cpu:{i}" for i in range(conv_replicas)]
    fc = [f"/cpu:{conv_replicas + j}" for j in range(fc_replicas)]
    return {"conv": conv, "fc": fc, "host": host_device or f"/cpu:{total - 1}",
            "reference": conv}


def global_batches(x: Any, y: Any, batch_size: int, steps: int, seed: int
                   ) -> list[tuple[Any, Any]]:
    """``steps`` global batches ``(x [batch_size, ...], y [batch_size])`` of a seeded
    permutation (cycled when the data run out)."""
    import numpy as np

    if batch_size > len(x):
        raise ValueError(f"batch_size {batch_size} exceeds the {len(x)} training examples")
    rng = np.random.default_rng(seed)
    order, out = rng.permutation(len(x)), []
    per_epoch = len(x) // batch_size
    for s in range(steps):
        if s and s % per_epoch == 0:
            order = rng.permutation(len(x))
        idx = order[(s % per_epoch) * batch_size:(s % per_epoch + 1) * batch_size]
        out.append((x[idx], y[idx].astype("int32")))
    return out


def train_data_parallel(make_model: Callable[[], Any], weights: Sequence[Any],
                        batches: Sequence[tuple[Any, Any]], devices: Sequence[str], lr: float,
                        momentum: float, compression: dict | None = None,
                        strategy: Any = None) -> list[Any]:
    """Plain data parallelism on the same global batches: the reference of the hybrid run.

    ``MirroredStrategy`` over ``devices`` (or ``strategy``); replica ``r`` takes the ``r``-th
    consecutive slice of each global batch and the gradient of ``sum(its losses) / B``; the
    strategy all-reduces (dense, or ``BlockSparseCrossDeviceOps`` with the spec's options) and
    SGD with ``momentum`` updates.

    Args:
        make_model: Builds the model (called under the strategy's scope).
        weights: Initial weights (``get_weights()`` order).
        batches: Global batches ``(x [B, ...], y [B])``.
        devices: Devices of the strategy (ignored when ``strategy`` is given).
        lr: SGD learning rate.
        momentum: SGD momentum.
        compression: ``None`` or ``{"k", "density", "metric"}`` for the block-sparse ops.
        strategy: Optional existing strategy.

    Returns:
        The trained weights (``get_weights()`` order).
    """
    import keras
    import tensorflow as tf

    import tf_blocksparse as tfbs
    from tf_blocksparse.hybrid.sync import check_compression
    from tf_blocksparse.runtime.slicing import split_sizes

    ops = None
    if strategy is None:
        # the spec converted as HybridTrainer converts it: every variable compressed
        # reduction to one device, not collectives: those would wait for the group leader
        # of a cluster this process is connected to (--workers)
        ops = (tfbs.BlockSparseCrossDeviceOps(check_compression(compression, "compression"))
               if compression else tf.distribute.ReductionToOneDevice())
        strategy = tf.distribute.MirroredStrategy(list(devices), cross_device_ops=ops)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with strategy.scope():
        model = make_model()
        model.set_weights(weights)
        opt = keras.optimizers.SGD(lr, momentum=momentum)
        opt.build(model.trainable_variables)
    if compression:
        ops.bind_model(model)
    n = strategy.num_replicas_in_sync

    def replica_step(x: tf.Tensor, y: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / batch
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x: Any, y: Any, batch: tf.Tensor) -> tf.Tensor:
        per = strategy.run(replica_step, args=(x, y, batch))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)

    def distribute(a: Any) -> Any:
        sizes = split_sizes(len(a), n)
        starts = [sum(sizes[:r]) for r in range(n)]

        def part(ctx: Any) -> Any:
            r = ctx.replica_id_in_sync_group
            return a[starts[r]:starts[r] + sizes[r]]

        return strategy.experimental_distribute_values_from_function(part)

    for x, y in batches:
        step(distribute(x), distribute(y), tf.constant(float(len(x))))
    return model.get_weights()


def short_device(name: str) -> str:
    """``CPU:3`` for a device of this process, the full name for a worker task's."""
    return name.split("device:")[-1] if name.startswith("/job:localhost/") else name


def group_summary(placement: dict, plan: Any) -> dict[str, Any]:
    """Per group: compute devices, the devices holding variables / optimizer state /
    residuals, the expanded layers and the planner's bytes per replica."""
    out = {}
    for group in ("conv", "fc"):
        reps = placement[group]
        short = {k: sorted({short_device(d) for r in reps for d in r[k].values()})
                 for k in ("variables", "optimizer_slots", "residuals")}
        out[group] = {"compute_devices": [r["compute_device"] for r in reps],
                      "variable_devices": short["variables"],
                      "optimizer_state_devices": short["optimizer_slots"],
                      "residual_devices": short["residuals"],
                      "planned_bytes_per_replica": dict(plan.group_bytes[group])}
    out["expanded_layers"] = placement["expanded_layers"]
    out["host_device"] = placement["host_device"]
    return out
