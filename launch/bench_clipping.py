"""Layer-wise local clipping before a per-group exchange: overlap with backward, and step time.

Everything runs in one process on one ``MirroredStrategy(["/cpu:0", "/cpu:1"])`` (two logical
CPUs: TF gives every instance the same collective keys, so a second instance that runs
collectives would clash).  Every variant has its own copy of the model (identical initial
weights), its own optimizer (built under the strategy before tracing) and the same
``tf.function`` step::

    strategy.run(replica_fn):  forward, loss / replicas, tape.gradient,
                               optimizer.apply(grads, variables)

on the same fixed random batch (``--batch`` per replica).  The inner optimizer is always
``SGD(0.05, momentum=0.9)``.  Prints one JSON object with:

``overlap``
    A TF profiler trace (``tf.profiler.experimental``; host tracer only) of ``--trace_steps``
    steps of ``BlockSparseOptimizer(SGD, k=1, exchange="allgather",
    clipping=[LocalNormClip(--threshold)])`` with ``fusion_buffer_bytes=--buffer_bytes``
    (``fused``: one set of collectives per balanced group) and with ``None``
    (``single_group``: every collective waits for the last gradient).  Each step is its own
    profiler session; its ``*.xplane.pb`` is parsed with ``xplane_pb2``: on the ``/host:CPU``
    plane an executed TF op is an event whose metadata name is ``"<op name>:<op type>"``
    (the metadata's display name is the type); events lie on per-thread lines
    (``tf_Compute/...`` for kernels, ``collective_ops/...`` for collective kernels) at
    ``line.timestamp_ns * 1000 + offset_ps``.  Every op is assigned to a replica by its
    device in the traced step's graph (fallback: a ``replica_<i>/`` name scope, else left
    out).  Per replica:

    - *backward ops*: ops with a ``gradient_tape`` / ``gradients`` name-scope component, or
      of a backprop type (type containing ``Backprop`` or ending in ``Grad``, e.g.
      ``_MklNativeConv2DBackpropFilter``, ``ReluGrad``, ``FusedBatchNormGradV3``); the
      *backward window* runs from the first one's start to the last one's end;
    - *exchange*: the collective kernels (type starting with ``Collective`` or ``Nccl``,
      except ``CollectiveAssignGroupV2`` / ``CollectiveInitializeCommunicator``).  A kernel's
      event runs from its launch on that replica (after parameter resolution) to its
      completion, so it includes waiting for the other replica;
    - ``exchange_overlap_fraction`` = length of (union of the replica's exchange intervals
      intersected with its backward window) / length of that union, pooled over replicas
      (sum of the numerators / sum of the denominators).  Also the exchange's tail after
      the backward window (last collective end - backward end, at least 0) and the first
      collective's start minus the backward end (negative: launched while backward ran);
    - ``joint_exchange_overlap_fraction``: the same without waiting for the peer: each
      collective instance (``instance_key`` stat) counts from its launch on the *last*
      replica to its last completion, against the window from the first backward op of
      any replica to the last one of any replica.

    Per variant the per-step figures and their medians are reported, plus the op types of
    the collectives seen and their number per replica.

    Scheduling caveat (seen in these traces): with TF's default inter-op pool (one thread
    per core; 2 here) the executor runs the input-gradient chain depth-first and
    leaves many weight-gradient ops (e.g. the logits' ``BiasAddGrad``, the second conv of
    each residual block) queued until the chain reaches the first layer, so the first fusion
    group's gradients are only complete at the very end of the backward and the per-group
    exchange barely overlaps.  ``--inter_op_threads`` (e.g. 8) makes those ops run as soon
    as they are ready, and the groups' collectives then interleave with the backward.
``step_time``
    Median wall time of one step (``.numpy()`` of the summed loss), the variants run
    interleaved (A B C D E A B C D E ...) after ``--warmup`` untimed rounds:

    - ``local_clip_dense``: ``BlockSparseOptimizer(SGD, exchange="dense",
      clipping=LocalNormClip(t), fusion_buffer_bytes=B)`` (layer-wise local clipping, then
      one dense all-reduce per group);
    - ``local_clip_allgather``: the same with ``exchange="allgather", k=1`` (the ``fused``
      variant above);
    - ``global_clipnorm``: ``SGD(..., global_clipnorm=t)``.  Keras 3 (TF backend) clips in
      ``apply`` *before* ``_backend_update_step`` all-reduces, so under a strategy this
      clips the global norm of each replica's *local* (1 / replicas scaled) gradients; a
      global norm needs every gradient, so the one batched all-reduce waits for the whole
      backward either way;
    - ``no_clip``: plain ``SGD``;
    - ``reduce_then_global_clip``: ``SGD`` that clips the global norm of the *all-reduced*
      gradients (its ``_all_reduce_sum_gradients`` hook reduces, then clips), i.e. clipping
      after aggregation.

    Ratios are against ``global_clipnorm``.

    python -m launch.bench_clipping [--model=resnet20] [--batch=16] [--repeats=15]
        [--inter_op_threads=8] [--logdir=/tmp/trace]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from launch import runtime, script
from launch import trace_analysis as trace
from launch.clipping_variants import (
    BASELINE,
    DESCRIPTIONS,
    LEARNING_RATE,
    MOMENTUM,
    OVERLAP_VARIANTS,
    STEP_VARIANTS,
    make_optimizer,
)
from models.registry import build_image_model
from tf_blocksparse.distribute.strategy import cross_device_ops
from tf_blocksparse.fusion import plan_backward

FLAGS = flags.FLAGS
MODELS = ("resnet20", "cnn_bn")
CLASSES = 10
def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_enum("model", "resnet20", MODELS,
                      "Registry model: resnet20 or cnn_bn (4 conv-BN blocks + dense head).")
    flags.DEFINE_integer("image_size", 32, "Input height / width.")
    flags.DEFINE_integer("batch", 16, "Batch size per replica.")
    flags.DEFINE_integer("warmup", 3, "Untimed interleaved rounds before the timed ones.")
    flags.DEFINE_integer("repeats", 15, "Timed interleaved rounds (median).", lower_bound=1)
    flags.DEFINE_integer("trace_steps", 3, "Profiled steps per overlap variant (median).",
                         lower_bound=1)
    flags.DEFINE_integer("buffer_bytes", 0,
                         "Fusion buffer in bytes; 0: a quarter of the model's gradient bytes.")
    flags.DEFINE_float("threshold", 1.0, "Clipping threshold t (LocalNormClip, global norm).")
    flags.DEFINE_integer("inter_op_threads", 0,
                         "TF inter-op threads (set before TF initialises); 0: TF's default.")
    flags.DEFINE_string("logdir", "", "Profiler log directory (kept); default a temporary "
                                      "directory, removed at the end.")


def make_train_step(strategy: tf.distribute.Strategy, model: keras.Model,
                    optimizer: keras.optimizers.Optimizer) -> Callable[[Any, Any], tf.Tensor]:
    """A ``tf.function``: forward, loss / replicas, gradients, ``optimizer.apply``."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def replica_fn(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / ctx.num_replicas_in_sync
        grads = tape.gradient(loss, variables)
        optimizer.apply(grads, variables)
        return loss

    @tf.function
    def train_step(x: Any, y: Any) -> tf.Tensor:
        per_replica = strategy.run(replica_fn, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return train_step


@dataclasses.dataclass
class Variant:
    """One model copy, its optimizer and its traced step."""

    name: str
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    step: Callable[[Any, Any], tf.Tensor]
    first_call_s: float = 0.0


def build_variants(strategy: tf.distribute.Strategy, names: Sequence[str], model_name: str,
                   image_size: int, threshold: float, buffer_bytes: int
                   ) -> dict[str, Variant]:
    """Builds every variant under ``strategy`` with identical initial weights."""
    out: dict[str, Variant] = {}
    weights = None
    for name in names:
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = build_image_model(model_name, image_size, CLASSES)
            if weights is None:
                weights = model.get_weights()
            else:
                model.set_weights(weights)
            optimizer = make_optimizer(name, threshold, buffer_bytes)
            optimizer.build(model.trainable_variables)
        out[name] = Variant(name, model, optimizer,
                            make_train_step(strategy, model, optimizer))
    return out


def gradient_nbytes(model: keras.Model) -> list[int]:
    """Bytes of each trainable variable's gradient, in variable order."""
    return [int(np.prod(v.shape, dtype=np.int64)) * int(tf.as_dtype(v.dtype).size)
            for v in model.trainable_variables]


def fusion_groups(model: keras.Model, buffer_bytes: int | None) -> int:
    """Fusion groups ``BlockSparseOptimizer`` forms for ``model`` at ``buffer_bytes``."""
    if buffer_bytes is None:
        return 1
    dtypes = [tf.as_dtype(v.dtype).name for v in model.trainable_variables]
    return len(plan_backward(gradient_nbytes(model), dtypes, buffer_bytes).groups)


def trace_variant(variant: Variant, x: Any, y: Any, steps: int, logdir: str,
                  devices: Sequence[str]) -> dict:
    """Profiles ``steps`` single steps of a warmed-up variant and summarises them."""
    placement = trace.replica_devices(variant.step.get_concrete_function(x, y).graph, devices)
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=2, python_tracer_level=0, device_tracer_level=0)
    results = []
    for i in range(steps):
        step_dir = os.path.join(logdir, f"{variant.name}_{i}")
        tf.profiler.experimental.start(step_dir, options=options)
        try:
            variant.step(x, y).numpy()
        finally:
            tf.profiler.experimental.stop()
        results.append(trace.analyse_step(trace.read_op_events(step_dir), placement, len(devices)))

    def med(key: str) -> float:
        return round(statistics.median(
            statistics.fmean(p[key] for p in res["per_replica"]) for res in results), 4)

    fractions = [res["exchange_overlap_fraction"] for res in results]
    joint = [res["joint_exchange_overlap_fraction"] for res in results]
    return {
        "description": DESCRIPTIONS[variant.name],
        "fusion_groups": fusion_groups(variant.model, variant.optimizer.fusion_buffer_bytes),
        "exchange_overlap_fraction": round(statistics.median(fractions), 4),
        "exchange_overlap_fraction_per_step": [round(f, 4) for f in fractions],
        "joint_exchange_overlap_fraction": round(statistics.median(joint), 4),
        "joint_exchange_overlap_fraction_per_step": [round(f, 4) for f in joint],
        "joint_exchange_ms": round(statistics.median(
            res["joint_exchange_ms"] for res in results), 4),
        "joint_instances": results[0]["joint_instances"],
        "backward_ms": med("backward_ms"), "exchange_ms": med("exchange_ms"),
        "exchange_in_backward_ms": med("exchange_in_backward_ms"),
        "first_exchange_start_minus_backward_end_ms": med(
            "first_exchange_start_minus_backward_end_ms"),
        "exchange_tail_after_backward_ms": med("exchange_tail_after_backward_ms"),
        "collectives_per_replica": results[0]["per_replica"][0]["collectives"],
        "backward_ops_per_replica": results[0]["per_replica"][0]["backward_ops"],
        "collective_types": results[0]["collective_types"],
        "unassigned_backward_or_exchange_ops": max(
            res["unassigned_backward_or_exchange_ops"] for res in results),
        "steps": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in p.items()}
                  | {"replica": r, "step": s}
                  for s, res in enumerate(results) for r, p in enumerate(res["per_replica"])],
    }


# ----------------------------------------------------------------------------------- run


def run(model: str = "resnet20", image_size: int = 32, batch: int = 16, warmup: int = 3,
        repeats: int = 15, trace_steps: int = 3, buffer_bytes: int = 0,
        threshold: float = 1.0, logdir: str = "",
        strategy: tf.distribute.Strategy | None = None) -> dict:
    """Builds the variants, times them, traces the overlap ones; returns the JSON record.

    Args:
        strategy: A ``MirroredStrategy`` over two CPU devices; ``None`` creates the logical
            CPUs (TF must not be initialised yet) and one strategy.
        Others: as the flags of the same names (``logdir=""``: a temporary directory,
            removed at the end).
    """
    if strategy is None:
        runtime.logical_cpus(2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    devices = list(strategy.extended.worker_devices)
    t0 = time.perf_counter()
    probe = build_image_model(model, image_size, CLASSES)
    grad_bytes = sum(gradient_nbytes(probe))
    n_vars = len(probe.trainable_variables)
    del probe
    if buffer_bytes <= 0:
        buffer_bytes = max(1, grad_bytes // 4)
    variants = build_variants(strategy, ("single_group", *STEP_VARIANTS), model, image_size,
                              threshold, buffer_bytes)
    variants["fused"] = dataclasses.replace(variants["local_clip_allgather"], name="fused")
    x, y = runtime.replica_batch(strategy, batch, image_size, CLASSES)
    calls = {name: (lambda v=variants[name]: v.step(x, y))
             for name in ("single_group", *STEP_VARIANTS)}
    for name, call in calls.items():
        variants[name].first_call_s = runtime.time_call(call)
    t1 = time.perf_counter()

    times = {v: [1000 * t for t in ts] for v, ts in runtime.interleaved_seconds(
        {v: calls[v] for v in STEP_VARIANTS}, repeats, warmup).items()}
    median = {v: statistics.median(t) for v, t in times.items()}
    t2 = time.perf_counter()

    own_dir = not logdir
    root = tempfile.mkdtemp(prefix="bench_clipping_") if own_dir else logdir
    try:
        overlap_variants = {v: trace_variant(variants[v], x, y, trace_steps, root, devices)
                            for v in OVERLAP_VARIANTS}
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    t3 = time.perf_counter()
    fused = overlap_variants["fused"]["exchange_overlap_fraction"]
    single = overlap_variants["single_group"]["exchange_overlap_fraction"]
    return {
        "config": {
            "model": model, "image_size": image_size, "batch_per_replica": batch,
            "replicas": strategy.num_replicas_in_sync, "devices": devices,
            "cross_device_ops": type(cross_device_ops(strategy)).__name__,
            "variables": n_vars, "gradient_bytes": grad_bytes, "buffer_bytes": buffer_bytes,
            "threshold": threshold,
            "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
            "inner_optimizer": f"SGD(learning_rate={LEARNING_RATE}, momentum={MOMENTUM})",
            "step": "tf.function(strategy.run(forward, loss / replicas, tape.gradient, "
                    "optimizer.apply(grads, variables)))",
        },
        "overlap": {
            "method": "tf.profiler.experimental host trace, one session per step, "
                      "xplane_pb2 /host:CPU op events",
            "logdir": None if own_dir else root,
            "trace_steps": trace_steps,
            "backward_ops": trace.BACKWARD_RULE, "exchange_ops": trace.COLLECTIVE_RULE,
            "fraction": "sum over replicas of |union(exchange) & backward window| / "
                        "sum of |union(exchange)|",
            "joint_fraction": "per collective instance [last replica's launch, last end]; "
                              "|union & [first backward op, last backward op] over both "
                              "replicas| / |union|",
            "variants": overlap_variants,
            "fused_overlap_exceeds_single_group": fused > single,
            "fused_joint_overlap_exceeds_single_group": (
                overlap_variants["fused"]["joint_exchange_overlap_fraction"]
                > overlap_variants["single_group"]["joint_exchange_overlap_fraction"]),
        },
        "step_time": {
            "warmup": warmup, "repeats": repeats, "baseline": BASELINE,
            "variants": {v: {
                "description": DESCRIPTIONS[v],
                "median_ms": round(median[v], 3),
                "times_ms": [round(t, 3) for t in times[v]],
                f"ratio_vs_{BASELINE}": round(median[v] / median[BASELINE], 4),
                "fusion_groups": (fusion_groups(variants[v].model, buffer_bytes)
                                  if v.startswith("local_clip") else 1),
                "first_call_s": round(variants[v].first_call_s, 3),
            } for v in STEP_VARIANTS},
        },
        "section_seconds": {"build_and_trace": round(t1 - t0, 2),
                            "step_time": round(t2 - t1, 2), "overlap": round(t3 - t2, 2)},
        "machine": runtime.machine_info(),
    }


def main(argv: list[str]) -> None:
    """Prints :func:`run`'s record for the flags as one JSON object."""
    del argv
    if FLAGS.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    runtime.logical_cpus(2)
    print(json.dumps(run(
        model=FLAGS.model, image_size=FLAGS.image_size, batch=FLAGS.batch,
        warmup=FLAGS.warmup, repeats=FLAGS.repeats, trace_steps=FLAGS.trace_steps,
        buffer_bytes=FLAGS.buffer_bytes, threshold=FLAGS.threshold, logdir=FLAGS.logdir)))


if __name__ == "__main__":
    script.run(main, define_flags)
