"""Balanced tensor fusion against TF / DDP / Horovod bucketing: plans, cycle simulation, step time.

Prints one JSON object (all in one process) with:

``plans``
    For each variable set (``keras.applications`` ResNet-50 / VGG-16, ``weights=None``, float32
    bytes; execution order *derived* from a trace of the forward pass, the reverse of the order
    it first reads the variables, :mod:`tf_blocksparse.fusion.forward_order`; every method gets
    that same order) and each ``--buffer_mib``: every method of
    :func:`~tf_blocksparse.planning.compare_plans` (groups, largest / smallest bytes,
    imbalance, ``imbalance_excluding_oversized``: groups holding a tensor that fills the buffer
    left out, and the strict ``imbalance_excluding_single_oversized``: only groups that are one
    single tensor larger than the buffer left out), the exact optimum of the former over every
    valid plan (:func:`~tf_blocksparse.planning.min_imbalance`: whether 1.25 is
    reachable at all) and whether the balanced plan meets ``largest/smallest <= 1.25`` either
    way.  ``defaults``: the baselines at their own defaults whatever the buffer (DDP: 25 MiB
    buckets, 1 MiB first bucket; Horovod greedy: 128 MiB).
``simulation``
    Gradient-ready times *measured* from real backward passes of ``--sim_model`` on this
    machine (one timestamp per gradient, median over ``--sim_steps`` steps, seconds after the
    loss), fed to :func:`~tf_blocksparse.planning.simulate` (balanced plan) and
    :func:`~tf_blocksparse.planning.simulate_greedy_cycles` (Horovod cycles) with a
    ``--cycle_ms`` cycle and a buffer of ``total_bytes / --sim_buffer_divisor``.
``step_time``
    A 2-replica ``MirroredStrategy`` training step on the two logical CPUs (forward, loss /
    replicas, gradients, reduction, plain SGD ``v -= lr * g`` through ``merge_call`` +
    ``extended.update``) with four reductions, timed interleaved in the same process:
    ``per_tensor`` (one ``all_reduce`` per gradient), ``tf_default`` (one batched
    ``all_reduce``: TF packs everything), ``tf_bytes_per_pack`` (the same with
    ``bytes_per_pack=--pack_mib``) and ``balanced`` (one ``all_reduce`` per
    :func:`~tf_blocksparse.fusion.plan_balanced` group: concat, reduce, split).

Non-finite ratios (a group of 0 bytes) are written as ``null``.  ``--sections=plans`` runs
only the (quick, CPU-light) plans section.

    python -m launch.bench_fusion [--buffer_mib=4,16,25,64] [--cycle_ms=5] [--pack_mib=4]
        [--sections=plans,simulation,step_time]
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from launch import runtime, script
from launch.fusion_plans import (
    finite_round,
    model_execution_order,
    plans_section,
    tensor_specs,
)
from launch.fusion_step import step_time_section
from models.registry import build_image_model
from tf_blocksparse.planning import (
    execution_order,
    plan_balanced,
    simulate,
    simulate_greedy_cycles,
)

FLAGS = flags.FLAGS
SECTIONS = ("plans", "simulation", "step_time")
MODELS = ("resnet50", "vgg16", "cnn_bn")


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_list("buffer_mib", ["4", "16", "25", "64"], "Fusion buffer sizes for `plans`.")
    flags.DEFINE_list("plan_models", ["resnet50", "vgg16"], "Variable sets for `plans`.")
    flags.DEFINE_enum("sim_model", "resnet50", MODELS, "Model whose backward pass is timed.")
    flags.DEFINE_integer("sim_image_size", 64, "Input height/width of the simulation model.")
    flags.DEFINE_integer("sim_batch", 8, "Batch size of the simulation model.")
    flags.DEFINE_integer("sim_warmup", 3, "Untimed backward passes before the timed ones.")
    flags.DEFINE_integer("sim_steps", 5, "Timed backward passes (median per tensor).")
    flags.DEFINE_float("cycle_ms", 5.0, "Scheduler cycle time in milliseconds.")
    flags.DEFINE_integer("sim_buffer_divisor", 8, "Simulation buffer = total bytes / this.")
    flags.DEFINE_enum("step_model", "resnet50", MODELS, "Model of the 2-replica step.")
    flags.DEFINE_integer("step_image_size", 32, "Input height/width of the step model.")
    flags.DEFINE_integer("step_batch", 8, "Batch size per replica of the step.")
    flags.DEFINE_integer("warmup", 2, "Untimed interleaved rounds of the step.")
    flags.DEFINE_integer("repeats", 11, "Timed interleaved rounds of the step (median).",
                         lower_bound=1)
    flags.DEFINE_float("pack_mib", 4.0, "bytes_per_pack / balanced buffer of the step, MiB.")
    flags.DEFINE_list("sections", list(SECTIONS), "Sections to run (plans is the quick one).")
    flags.register_validator("sections", lambda s: bool(s) and set(s) <= set(SECTIONS),
                             f"--sections must be a non-empty subset of {list(SECTIONS)}")


# ---------------------------------------------------------------------------- simulation


def measure_ready_times(model: keras.Model, batch: int, image_size: int, warmup: int,
                        steps: int, classes: int = 10) -> tuple[list[float], float, float]:
    """Times when each gradient of a real backward pass is ready, seconds after the loss.

    The step is a ``tf.compat.v1.wrap_function`` graph: unlike ``tf.function`` it adds no
    automatic control dependencies, which would chain the (stateful) timestamps in program
    order.  One timestamp is taken after the loss and seeds the backward pass (the output
    gradient depends on it, so no backward op starts earlier); one is taken under
    ``control_dependencies([g_i])`` for every gradient.  The gradients' sum is fetched so the
    backward pass is not pruned.

    Returns:
        ``(ready_times_s, forward_s, backward_s)``: per trainable variable the median over
        ``steps`` of its gradient's ready time (clamped at 0), and the medians of the forward
        pass (input to loss) and of the backward pass (loss to last gradient).
    """
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, image_size, image_size, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, size=(batch,)), dtype=tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def step() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        t_in = tf.timestamp()
        with tf.control_dependencies([t_in]):
            inputs = tf.identity(x)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(inputs, training=True))
        with tf.control_dependencies([loss]):
            t_loss = tf.timestamp()
            seed = tf.ones_like(loss)
        with tf.control_dependencies([t_loss]):
            seed = tf.identity(seed)
        grads = tape.gradient(loss, variables, output_gradients=seed)
        stamps = []
        for g in grads:
            with tf.control_dependencies([g]):
                stamps.append(tf.timestamp())
        total = tf.add_n([tf.reduce_sum(g) for g in grads])
        return t_in, t_loss, tf.stack(stamps), total

    fn = tf.compat.v1.wrap_function(step, signature=[])
    for _ in range(warmup):
        fn()
    rel, fwd = [], []
    for _ in range(steps):
        t_in, t_loss, stamps, _ = fn()
        rel.append((stamps - t_loss).numpy())
        fwd.append(float(t_loss - t_in))
    ready = np.maximum(np.median(np.stack(rel), axis=0), 0.0)
    backward = float(np.median(np.max(np.stack(rel), axis=1)))
    return [float(t) for t in ready], statistics.median(fwd), backward


def _order_inversions(ready: Sequence[float], order: Sequence[int] | None = None) -> float:
    """Fraction of tensor pairs ready in the opposite order to ``order`` (default: the
    fallback :func:`execution_order`, the reverse of the variable list)."""
    order = list(execution_order(len(ready)) if order is None else order)
    pairs = inv = 0
    for a in range(len(order)):
        for b in range(a + 1, len(order)):
            pairs += 1
            inv += ready[order[a]] > ready[order[b]]
    return inv / pairs if pairs else 0.0


def _sim_summary(result: dict) -> dict:
    return {
        "collectives": result["collectives"],
        "fused_bytes_per_cycle": result["fused_bytes_per_cycle"],
        "largest_bytes": result["largest_bytes"], "smallest_bytes": result["smallest_bytes"],
        "imbalance": finite_round(result["imbalance"]),
        "last_start_s": finite_round(result["last_start_s"], 6),
    }


def simulation_section(model_name: str, image_size: int, batch: int, warmup: int, steps: int,
                       cycle_ms: float, buffer_divisor: int) -> dict:
    """``simulation``: measured ready times through the balanced and Horovod schedulers."""
    model = build_image_model(model_name, image_size, 10)
    specs = tensor_specs(model.trainable_variables)
    order = model_execution_order(model)
    ready, forward_s, backward_s = measure_ready_times(model, batch, image_size, warmup, steps)
    del model
    gc.collect()
    total = sum(s.nbytes for s in specs)
    buffer_bytes = max(1, total // buffer_divisor)
    cycle_s = cycle_ms / 1000
    plan = plan_balanced(specs, buffer_bytes, order)
    return {
        "model": model_name, "image_size": image_size, "batch": batch, "warmup": warmup,
        "steps": steps, "tensors": len(specs), "total_bytes": total,
        "buffer_bytes": buffer_bytes, "cycle_s": cycle_s,
        "forward_s": finite_round(forward_s, 6), "backward_s": finite_round(backward_s, 6),
        "ready_order_inversions": finite_round(_order_inversions(ready)),
        "ready_order_inversions_derived": finite_round(_order_inversions(ready, order)),
        "ready_times_s": [round(t, 6) for t in ready],
        "methods": {
            "balanced": _sim_summary(simulate(plan, ready, cycle_s)),
            "horovod_cycles": _sim_summary(
                simulate_greedy_cycles(specs, ready, cycle_s, buffer_bytes)),
        },
    }


# ----------------------------------------------------------------------------------- run


def run(buffer_mib: Sequence[float] = (4, 16, 25, 64),
        plan_models: Sequence[str] = ("resnet50", "vgg16"),
        sim_model: str = "resnet50", sim_image_size: int = 64, sim_batch: int = 8,
        sim_warmup: int = 3, sim_steps: int = 5, cycle_ms: float = 5.0,
        sim_buffer_divisor: int = 8, step_model: str = "resnet50", step_image_size: int = 32,
        step_batch: int = 8, warmup: int = 2, repeats: int = 11, pack_mib: float = 4.0,
        strategy: tf.distribute.Strategy | None = None,
        sections: Sequence[str] = SECTIONS) -> dict:
    """Runs the chosen sections and returns the record printed by the script.

    Args:
        strategy: The ``MirroredStrategy`` over two CPU devices to time the step on.  ``None``
            creates the logical CPUs (TF must not be initialised yet) and one strategy; pass
            one when the process already has one (TF gives every instance the same
            collective keys, so two instances that both run collectives clash).
        sections: Which of :data:`SECTIONS` to run (the record holds only those).
        Others: as the flags of the same names.
    """
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ValueError(f"`sections` must be a non-empty subset of {SECTIONS}, got "
                         f"{list(sections)!r}")
    runners = {
        "plans": lambda: plans_section(plan_models, [float(m) for m in buffer_mib]),
        "simulation": lambda: simulation_section(sim_model, sim_image_size, sim_batch,
                                                 sim_warmup, sim_steps, cycle_ms,
                                                 sim_buffer_divisor),
        "step_time": lambda: step_time_section(
            strategy if strategy is not None else _default_strategy(), step_model,
            step_image_size, step_batch, warmup, repeats, pack_mib),
    }
    record: dict = {"section_seconds": {}}
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            record[name] = runners[name]()
            record["section_seconds"][name] = round(time.perf_counter() - t0, 2)
    record["machine"] = runtime.machine_info()
    return record


def _default_strategy() -> tf.distribute.MirroredStrategy:
    runtime.logical_cpus(2)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def main(argv: list[str]) -> None:
    """Prints :func:`run`'s record for the flags as one JSON object."""
    del argv
    runtime.logical_cpus(2)
    print(json.dumps(run(
        buffer_mib=[float(m) for m in FLAGS.buffer_mib], plan_models=FLAGS.plan_models,
        sim_model=FLAGS.sim_model, sim_image_size=FLAGS.sim_image_size,
        sim_batch=FLAGS.sim_batch, sim_warmup=FLAGS.sim_warmup, sim_steps=FLAGS.sim_steps,
        cycle_ms=FLAGS.cycle_ms, sim_buffer_divisor=FLAGS.sim_buffer_divisor,
        step_model=FLAGS.step_model, step_image_size=FLAGS.step_image_size,
        step_batch=FLAGS.step_batch, warmup=FLAGS.warmup, repeats=FLAGS.repeats,
        pack_mib=FLAGS.pack_mib, sections=FLAGS.sections)))


if __name__ == "__main__":
    script.run(main, define_flags)
