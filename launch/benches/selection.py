"""The body of ``launch.bench_selection``: :func:`measure` times block selection on a
registry model's variable shapes beside plain passes over the same tensors and returns the
record the script prints (its docstring describes the record).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from launch import runtime
from models import registry
from tf_blocksparse import blocks, codec, kernels, selection
from tf_blocksparse.feedback import BlockTopK


def _quartiles(values: list[float]) -> list[float]:
    """Lower quartile, median, upper quartile."""
    q = np.quantile(np.asarray(values), [0.25, 0.5, 0.75])
    return [round(float(v), 3) for v in q]


def measure(model_name: str, k: int | None, density: float | None, metric: str,
            repeats: int) -> dict:
    """Builds the variable set, runs every measurement side by side, returns the record."""
    model = registry.build_image_model(model_name)
    layouts = blocks.layouts_for(model.trainable_variables, model)
    del model
    comp = BlockTopK(layouts, k=k, density=density, metric=metric, dense_below=0)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.standard_normal(lay.shape, dtype=np.float32)) for lay in layouts]
    residuals = [tf.Variable(tf.zeros(lay.shape)) for lay in layouts]
    flat_k = [n * lay.block_size for n, lay in zip(comp.counts, layouts)]

    @tf.function
    def read_pass():
        return tf.add_n([tf.reduce_sum(tf.abs(g)) for g in grads])

    @tf.function
    def accumulate_pass():
        for r, g in zip(residuals, grads):
            r.assign_add(g)

    @tf.function
    def select():
        scores = [selection.block_scores(g, lay, metric) for g, lay in zip(grads, layouts)]
        ids = comp.select(scores)
        return [selection.gather_blocks(g, lay, i) for g, lay, i in zip(grads, layouts, ids)]

    @tf.function
    def flat_topk():
        return [tf.math.top_k(tf.reshape(g, [-1]), k=n).values for g, n in zip(grads, flat_k)]

    def compress_step():
        state = [r.read_value() for r in residuals]
        prepared = comp.prepare(grads, state)
        payload, new_state = comp.finish(prepared, comp.select(prepared.scores))
        id_buf = codec.pack(list(payload.ids))
        val_buf = codec.pack(list(payload.values))
        for r, s in zip(residuals, new_state):
            r.assign(s)
        return id_buf, val_buf

    compress = tf.function(compress_step)
    compress_tf = tf.function(compress_step)
    with kernels.tf_path():  # traced here: the pure-TensorFlow ops, for comparison
        compress_tf.get_concrete_function()

    rounds = runtime.interleaved_seconds({
        "read_pass_ms": read_pass, "accumulate_pass_ms": accumulate_pass,
        "select_ms": select, "compress_ms": compress, "flat_topk_ms": flat_topk,
        "compress_tf_ms": compress_tf}, repeats, warmup=2)
    timings = {name: 1000 * float(np.median(s)) for name, s in rounds.items()}

    def ratio_quartiles(num: str, den: str) -> list[float]:
        return _quartiles([a / b for a, b in zip(rounds[num], rounds[den])])

    id_buf, val_buf = compress()
    payload = codec.buffer_nbytes(id_buf) + codec.buffer_nbytes(val_buf)
    dense = sum(codec.buffer_nbytes(g) for g in grads)
    return {
        "model": model_name, "variables": len(layouts),
        "parameters": int(sum(lay.size for lay in layouts)),
        "kernels": kernels.path_name(), "k": comp.k, "density": comp.density,
        "metric": metric, "repeats": repeats,
        **{n: round(v, 3) for n, v in timings.items()},
        "select_over_read_pass": round(timings["select_ms"] / timings["read_pass_ms"], 3),
        "compress_over_accumulate_pass": round(
            timings["compress_ms"] / timings["accumulate_pass_ms"], 3),
        "flat_topk_over_select": round(timings["flat_topk_ms"] / timings["select_ms"], 3),
        "compress_tf_over_accumulate_pass": round(
            timings["compress_tf_ms"] / timings["accumulate_pass_ms"], 3),
        "compress_over_accumulate_pass_quartiles": ratio_quartiles(
            "compress_ms", "accumulate_pass_ms"),
        "flat_topk_over_select_quartiles": ratio_quartiles("flat_topk_ms", "select_ms"),
        "payload_bytes": payload, "dense_bytes": dense,
        "compression_ratio": round(dense / payload, 1),
        "machine": runtime.machine_info(),
    }
