"""The body of ``launch.bench_fusion``: the ``simulation`` section and :func:`run`.

:func:`measure_ready_times` times when each gradient of a real backward pass is ready;
:func:`simulation_section` feeds those times to the balanced and the Horovod-cycle schedulers
of :mod:`tf_blocksparse.planning`.  :func:`run` runs the chosen sections (``plans`` from
:mod:`launch.fusion_plans`, ``step_time`` from :mod:`launch.fusion_step`) and returns the
record the script prints; the script's docstring describes the record.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from launch import runtime
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
        sections: Sequence[str] | None = None) -> dict:
    """Runs the chosen sections and returns the record printed by the script.

    Args:
        strategy: The ``MirroredStrategy`` over two CPU devices to time the step on.  ``None``
            creates the logical CPUs (TF must not be initialised yet) and one strategy; pass
            one when the process already has one (TF gives every instance the same
            collective keys, so two instances that both run collectives clash).
        sections: Which of the sections (:data:`launch.bench_fusion.SECTIONS`) to run,
            ``None``: all of them (the record holds only those run).
        Others: as the flags of the same names.
    """
    runners = {
        "plans": lambda: plans_section(plan_models, [float(m) for m in buffer_mib]),
        "simulation": lambda: simulation_section(sim_model, sim_image_size, sim_batch,
                                                 sim_warmup, sim_steps, cycle_ms,
                                                 sim_buffer_divisor),
        "step_time": lambda: step_time_section(
            strategy if strategy is not None else _default_strategy(), step_model,
            step_image_size, step_batch, warmup, repeats, pack_mib),
    }
    names = tuple(runners)
    sections = names if sections is None else tuple(sections)
    if not sections or not set(sections) <= set(names):
        raise ValueError(f"`sections` must be a non-empty subset of {names}, got "
                         f"{list(sections)!r}")
    record: dict = {"section_seconds": {}}
    for name, section in runners.items():
        if name in sections:
            t0 = time.perf_counter()
            record[name] = section()
            record["section_seconds"][name] = round(time.perf_counter() - t0, 2)
    record["machine"] = runtime.machine_info()
    return record


def _default_strategy() -> tf.distribute.MirroredStrategy:
    runtime.logical_cpus(2)
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
