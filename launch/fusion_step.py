"""The ``step_time`` section of ``launch.bench_fusion``: one 2-replica ``MirroredStrategy``
SGD step with each gradient reduction (per tensor, TF's batched all-reduce with and without
``bytes_per_pack``, one all-reduce per balanced fusion group, and the dense, bucketed
``BlockSparseCrossDeviceOps(fusion=plan)`` itself, recorded as ``fused_cross_device_ops``),
timed interleaved in one process."""

from __future__ import annotations

import statistics
from typing import Any

import keras
import tensorflow as tf

from launch import runtime
from launch.fusion_plans import MIB, model_execution_order, tensor_specs
from models.registry import build_image_model
from tf_blocksparse.distribute.cross_device_ops import BlockSparseCrossDeviceOps
from tf_blocksparse.distribute.strategy import cross_device_ops
from tf_blocksparse.planning import FusionPlan, plan_balanced, plan_tf_group_by_size

#: The gradient reductions the step is timed with.
STEP_METHODS = ("per_tensor", "tf_default", "tf_bytes_per_pack", "balanced")
UPDATE_NOTE = ("plain SGD v -= lr * reduced_g on every replica via merge_call + "
               "strategy.extended.update (BatchNorm moving statistics update in replica)")


def _reduce(ctx: tf.distribute.ReplicaContext, grads: list[tf.Tensor], method: str,
            plan: FusionPlan, pack_bytes: int) -> list[tf.Tensor]:
    """SUM-all-reduces ``grads`` across replicas with one of :data:`STEP_METHODS`."""
    op = tf.distribute.ReduceOp.SUM
    if method == "per_tensor":
        return [ctx.all_reduce(op, g) for g in grads]
    if method == "tf_default":
        return list(ctx.all_reduce(op, grads))
    if method == "tf_bytes_per_pack":
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes)
        return list(ctx.all_reduce(op, grads, options=options))
    if method != "balanced":
        raise ValueError(f"unknown method {method!r}")
    out: list[tf.Tensor | None] = [None] * len(grads)
    for group in plan.groups:
        members = list(group.members)
        parts = [tf.reshape(grads[i], [-1]) for i in members]
        summed = ctx.all_reduce(op, parts[0] if len(parts) == 1 else tf.concat(parts, 0))
        sizes = [int(grads[i].shape.num_elements()) for i in members]
        pieces = tf.split(summed, sizes) if len(sizes) > 1 else [summed]
        for i, piece in zip(members, pieces):
            out[i] = tf.reshape(piece, grads[i].shape)
    return out  # type: ignore[return-value]


def make_train_step(strategy: tf.distribute.Strategy, model: keras.Model, method: str,
                    plan: FusionPlan, pack_bytes: int, batch: int,
                    lr: float = 1e-3) -> Any:
    """A ``tf.function`` running one 2-replica SGD step with the given gradient reduction."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    variables = model.trainable_variables

    def apply(strat: tf.distribute.Strategy, pairs: list[tuple[Any, Any]]) -> None:
        for grad, var in pairs:
            strat.extended.update(var, lambda v, g: v.assign_sub(lr * g), args=(grad,))

    def replica_fn(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / (batch * ctx.num_replicas_in_sync)
        grads = tape.gradient(loss, variables)
        reduced = _reduce(ctx, grads, method, plan, pack_bytes)
        ctx.merge_call(apply, args=(list(zip(reduced, [v.value for v in variables])),))
        return loss

    return runtime.summed_step(strategy, replica_fn)


def step_time_section(strategy: tf.distribute.Strategy, model_name: str, image_size: int,
                      batch: int, warmup: int, repeats: int, pack_mib: float,
                      classes: int = 10) -> dict:
    """``step_time``: the reductions timed interleaved (A B C D E A B C D E ...); E is
    ``BlockSparseCrossDeviceOps(fusion=plan)`` itself (dense), under its own
    ``MirroredStrategy``."""
    with strategy.scope():
        model = build_image_model(model_name, image_size, classes)
    specs = tensor_specs(model.trainable_variables)
    pack_bytes = int(round(pack_mib * MIB))
    plan = plan_balanced(specs, pack_bytes, model_execution_order(model))
    collectives = {
        "per_tensor": len(specs), "tf_default": 1,
        "tf_bytes_per_pack": len(plan_tf_group_by_size(specs, pack_bytes).groups),
        "balanced": len(plan.groups),
    }

    x, y = runtime.replica_batch(strategy, batch, image_size, classes)
    steps = {m: (make_train_step(strategy, model, m, plan, pack_bytes, batch), x, y)
             for m in STEP_METHODS}
    # The shipped adapter: a MirroredStrategy whose cross-device ops follow the plan (its
    # reductions are one-device sums, like TF's CPU default, so no collective keys clash).
    fused = tf.distribute.MirroredStrategy(
        strategy.extended.worker_devices, cross_device_ops=BlockSparseCrossDeviceOps(fusion=plan))
    with fused.scope():
        fused_model = build_image_model(model_name, image_size, classes)
    steps["fused_cross_device_ops"] = (
        make_train_step(fused, fused_model, "tf_default", plan, pack_bytes, batch),
        *runtime.replica_batch(fused, batch, image_size, classes))
    collectives["fused_cross_device_ops"] = len(plan.groups)
    calls = {m: (lambda fn=fn, xs=xs, ys=ys: fn(xs, ys)) for m, (fn, xs, ys) in steps.items()}
    trace_s = {m: runtime.time_call(call) for m, call in calls.items()}
    times = {m: [1000 * t for t in ts]
             for m, ts in runtime.interleaved_seconds(calls, repeats, warmup).items()}
    median = {m: statistics.median(t) for m, t in times.items()}
    return {
        "model": model_name, "image_size": image_size, "batch_per_replica": batch,
        "replicas": strategy.num_replicas_in_sync,
        "cross_device_ops": type(cross_device_ops(strategy)).__name__,
        "variables": len(specs), "total_bytes": sum(s.nbytes for s in specs),
        "buffer_bytes": pack_bytes, "warmup": warmup, "repeats": repeats,
        "update": UPDATE_NOTE,
        "methods": {m: {
            "median_ms": round(median[m], 3), "times_ms": [round(t, 3) for t in times[m]],
            "ratio_vs_tf_default": round(median[m] / median["tf_default"], 4),
            "collectives_per_step": collectives[m], "first_call_s": round(trace_s[m], 3),
        } for m in steps},
    }
