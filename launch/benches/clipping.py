"""The body of ``launch.bench_clipping``: the variants, their steps, traces and timings.

:func:`build_variants` builds every variant of :mod:`launch.clipping_variants` (its own model
copy with the same initial weights, its optimizer, its traced ``tf.function`` step) under one
``MirroredStrategy``; :func:`trace_variant` profiles single steps and reads the overlap of the
exchange with the backward pass out of the traces (:mod:`launch.trace_analysis`); :func:`run`
times the steps interleaved and returns the record the script prints (its docstring
describes the record).
"""

from __future__ import annotations

import dataclasses
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

from launch import runtime
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

CLASSES = 10
#: Profiler sessions per traced step at most: a step is traced again while its trace misses
#: an event of some collective (:func:`launch.trace_analysis.complete`); the record keeps the
#: count per step (``trace_attempts``).
TRACE_ATTEMPTS = 3


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

    return runtime.summed_step(strategy, replica_fn)


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
    results, attempts = [], []
    for i in range(steps):
        step_dir = os.path.join(logdir, f"{variant.name}_{i}")
        attempt = 0
        while attempt < TRACE_ATTEMPTS:  # the host tracer may drop an event: trace again
            attempt += 1
            shutil.rmtree(step_dir, ignore_errors=True)
            tf.profiler.experimental.start(step_dir, options=options)
            try:
                variant.step(x, y).numpy()
            finally:
                tf.profiler.experimental.stop()
            result = trace.analyse_step(trace.read_op_events(step_dir), placement, len(devices))
            if trace.complete(result):
                break
        results.append(result)
        attempts.append(attempt)

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
        "unmatched_instances": max(res["unmatched_instances"] for res in results),
        "unkeyed_collectives": max(res["unkeyed_collectives"] for res in results),
        "trace_attempts": attempts,
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
