"""The body of ``launch.project_scaling``: the measurements of each model on this host and
:func:`run`, which projects them with :mod:`launch.scaling_report` and writes the JSON and
markdown files (the script's docstring describes the inputs and assumptions).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from launch import runtime
from launch.scaling_report import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_WORKERS,
    GPU_COMPUTE_S,
    GPU_SOURCE,
    HOROVOD,
    estimate_gpu_select_s,
    markdown_table,
    project,
    sanity_check,
    selection_label,
    summary,
)
from models import registry
from tf_blocksparse import blocks, codec
from tf_blocksparse.feedback import BlockTopK

SCHEMA = "tf_blocksparse.scaling/1"
#: The registry's ImageNet networks this script can project.
BUILDERS = registry.IMAGENET_MODELS


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn`` (after one warm-up call), results fetched to host."""
    return runtime.median_seconds(fn, max(1, repeats), warmup=1)


def variable_bytes(model: keras.Model) -> list[int]:
    """Gradient bytes per trainable variable (the dense exchange's tensors)."""
    return [codec.dense_nbytes(v.shape, v.dtype) for v in model.trainable_variables]


def measure_compute(model: keras.Model, batch: int, repeats: int) -> float:
    """Median seconds of one forward + backward step (no optimizer) at ``batch``."""
    shape = (batch, *model.input_shape[1:])
    x = tf.random.stateless_normal(shape, seed=(1, 2))
    y = tf.zeros((batch,), tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    return _median_s(lambda: step()[0], repeats)


def measure_selection(model: keras.Model, k: int | None, density: float | None,
                      repeats: int) -> dict[str, Any]:
    """Payload sizes (per variable, from one compress step) and compress time on this host."""
    layouts = blocks.layouts_for(model.trainable_variables, model)
    comp = BlockTopK(layouts, k=k, density=density, dense_below=0)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.standard_normal(lay.shape, dtype=np.float32)) for lay in layouts]
    residuals = [tf.Variable(tf.zeros(lay.shape)) for lay in layouts]

    @tf.function
    def compress():
        state = [r.read_value() for r in residuals]
        prepared = comp.prepare(grads, state)
        payload, new_state = comp.finish(prepared, comp.select(prepared.scores))
        for r, s in zip(residuals, new_state):
            r.assign(s)
        flag = tf.zeros((1,), tf.int32)  # allgather's non-finite flag rides in the id buffer
        return (codec.pack([*payload.ids, flag]), codec.pack(list(payload.values)),
                codec.pack(list(prepared.scores)))

    @tf.function
    def accumulate_pass():
        for r, g in zip(residuals, grads):
            r.assign_add(g)

    compress_s = _median_s(compress, repeats)
    accumulate_s = _median_s(accumulate_pass, repeats)
    # Per-variable sizes from the tensors one (eager) step produces.
    prepared = comp.prepare(grads, [r.read_value() for r in residuals])
    payload, _ = comp.finish(prepared, comp.select(prepared.scores))
    ids = [codec.buffer_nbytes(t) for t in payload.ids]
    values = [codec.buffer_nbytes(t) for t in payload.values]
    scores = [codec.buffer_nbytes(t) for t in prepared.scores]
    id_buf, val_buf, score_buf = compress()
    packed = (codec.buffer_nbytes(id_buf), codec.buffer_nbytes(val_buf),
              codec.buffer_nbytes(score_buf))
    if packed != (sum(ids) + 4, sum(values), sum(scores)):
        raise RuntimeError(f"packed buffer sizes {packed} differ from the per-variable sums")
    dense = sum(codec.buffer_nbytes(g) for g in grads)
    return {
        "k": comp.k, "density": comp.density, "blocks_kept": int(sum(comp.counts)),
        "blocks_total": int(sum(lay.num_blocks for lay in layouts)),
        "id_bytes": ids, "value_bytes": values, "score_bytes": scores,
        "allgather_bytes_per_worker": sum(ids) + 4 + sum(values),
        "shared_bytes_per_worker": sum(scores) + sum(values),
        "compression_ratio_allgather": round(dense / (sum(ids) + 4 + sum(values)), 2),
        "compression_ratio_shared": round(dense / (sum(scores) + sum(values)), 2),
        "select_s_cpu": compress_s, "accumulate_pass_s_cpu": accumulate_s,
    }


def measure(name: str, image_size: int, cpu_batch: int, repeats: int,
            selections: Sequence[tuple[int | None, float | None]]) -> dict[str, Any]:
    """Every measured input of one model."""
    keras.backend.clear_session()
    model = registry.build_image_model(name, image_size, 1000)
    sizes = variable_bytes(model)
    t0 = time.perf_counter()
    compute = measure_compute(model, cpu_batch, repeats)
    sels = {}
    for k, density in selections:
        sel = measure_selection(model, k, density, repeats)
        sels[selection_label(sel)] = sel
    return {
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "variables": len(sizes), "image_size": image_size, "dense_bytes": sum(sizes),
        "tensor_bytes": sizes, "cpu_batch": cpu_batch, "cpu_compute_s": compute,
        "selections": sels, "measure_seconds": round(time.perf_counter() - t0, 1),
    }


def run(models: Sequence[str] = ("resnet50", "vgg16"),
        workers: Sequence[int] = DEFAULT_WORKERS,
        bandwidths_gbit: Sequence[float] = DEFAULT_BANDWIDTHS,
        alpha_s: float = 25e-6, overlap: float = 2 / 3, image_size: int = 224,
        cpu_batch: int = 4, repeats: int = 3, k: int = 1, density: float = 0.01,
        gpu_compute_s: Mapping[str, float] | None = None, gpu_mem_gbps: float = 732.0,
        gpu_select_s: float | None = None, with_sanity_check: bool = True,
        out: str | os.PathLike[str] | None = "benchmarks/results/scaling.json",
        ) -> dict[str, Any]:
    """Measures, projects and (if ``out``) writes ``out`` and ``out`` with ``.md``.

    Returns:
        The result record (the JSON written).

    Raises:
        ValueError: Unknown models, empty ``workers`` / ``bandwidths_gbit``, or a bad
            number (named).
    """
    if not models:
        raise ValueError("models must not be empty")
    for m in models:
        if m not in BUILDERS:
            raise ValueError(f"models must be among {sorted(BUILDERS)}, got {m!r}")
    if not workers or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                          for w in workers):
        raise ValueError(f"workers must be non-empty ints >= 1, got {list(workers)!r}")
    if not bandwidths_gbit or any(not b > 0 for b in bandwidths_gbit):
        raise ValueError(f"bandwidths_gbit must be non-empty and > 0, got "
                         f"{list(bandwidths_gbit)!r}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if alpha_s < 0:
        raise ValueError(f"alpha_s must be >= 0, got {alpha_s}")
    if image_size < 32:
        raise ValueError(f"image_size must be >= 32, got {image_size}")
    if cpu_batch < 1 or repeats < 1:
        raise ValueError(f"cpu_batch and repeats must be >= 1, got {cpu_batch}, {repeats}")
    if gpu_mem_gbps <= 0:
        raise ValueError(f"gpu_mem_gbps must be > 0, got {gpu_mem_gbps}")
    gpu = dict(GPU_COMPUTE_S if gpu_compute_s is None else gpu_compute_s)
    for name, s in gpu.items():
        if not s > 0:
            raise ValueError(f"gpu_compute_s[{name!r}] must be > 0, got {s}")

    t0 = time.perf_counter()
    measured = {}
    for name in models:
        m = measure(name, image_size, cpu_batch, repeats, [(k, None), (None, density)])
        for sel in m["selections"].values():
            sel["select_s_gpu"] = estimate_gpu_select_s(sel, m["dense_bytes"], gpu_mem_gbps,
                                                gpu_select_s)
        measured[name] = m
        print(f"[project_scaling] measured {name} in {m['measure_seconds']} s", flush=True)
    sanity = None
    if with_sanity_check:
        sizes = {n: measured[n]["dense_bytes"] for n in measured if image_size == 224}
        for name in HOROVOD:
            if name not in sizes:
                keras.backend.clear_session()
                sizes[name] = sum(variable_bytes(registry.build_image_model(name, 224)))
        sanity = sanity_check(sizes, alpha_s, overlap, gpu)

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "tensorflow": tf.__version__,
                    "device": "GPU" if tf.config.list_physical_devices("GPU") else "CPU"},
        "assumptions": {
            "cost_model": "alpha-beta, flat ring: all-reduce 2(p-1)a + 2(p-1)/p n/B, "
                          "all-gather (p-1)a + (p-1) n/B; shared = all-reduce(scores) + "
                          "all-reduce(values); allgather = all-gather(ids+flag) + "
                          "all-gather(values); dense = one fused all-reduce (dense_per_tensor:"
                          " one per variable); efficiency = compute / (compute + select + "
                          "max(0, comm - overlap*compute))",
            "alpha_s": alpha_s, "overlap": overlap,
            "gpu_compute_s": gpu, "gpu_compute_source": GPU_SOURCE,
            "gpu_select": ("given" if gpu_select_s is not None else
                           f"estimated: CPU compress/accumulate ratio x 3 x dense bytes / "
                           f"{gpu_mem_gbps:g} GB/s"),
            "gradient_dtype": "float32",
        },
        "workers": list(workers), "bandwidths_gbit": [float(b) for b in bandwidths_gbit],
        "models": measured,
        "projections": project(measured, workers, bandwidths_gbit, alpha_s, overlap, gpu),
        "sanity_check": sanity,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result["summary"] = summary(result)
    if out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(os.path.splitext(os.fspath(out))[0] + ".md", "w", encoding="utf-8") as f:
            f.write(markdown_table(result) + "\n\n" + markdown_table(result, "cpu_measured")
                    + "\n")
    return result
