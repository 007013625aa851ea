"""The body of ``launch.bench_pipeline``: the ``host``, ``simulated`` and ``planning_time``
sections and :func:`run`, which returns the record the script prints (its docstring
describes the record).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from launch import runtime
from models.registry import build_model
from tf_blocksparse.pipeline.profiler import profile_model
from tf_blocksparse.pipeline.trainer import PipelineTrainer
from tf_blocksparse.planning import (
    ModelProfile,
    PipelinePlan,
    Topology,
    make_plan,
    plan_oblivious,
    plan_pipedream,
    plan_pipeline,
    random_profile,
    simulate_pipeline,
)

MIB = 2**20
#: The ``keras.applications`` networks of the ``simulated`` section (``--big_models``).
BIG_MODELS = {"resnet50": keras.applications.ResNet50, "vgg16": keras.applications.VGG16}
PLANNERS: dict[str, Callable[[ModelProfile, Topology], PipelinePlan]] = {
    "bandwidth_dp": plan_pipeline, "pipedream": plan_pipedream, "oblivious": plan_oblivious}


def _median(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    return runtime.median_seconds(fn, repeats, warmup, sync=tf.test.experimental.sync_devices)


def measure_bandwidth(devices: list[str], mib: float) -> dict:
    """Bytes/s of a cross-device ``tf.identity`` and of a same-memory copy (``x + 1``)."""
    n = int(mib * MIB) // 4
    with tf.device(devices[0]):
        x = tf.Variable(tf.ones([n]))
    dst = devices[1 % len(devices)]

    @tf.function
    def cross() -> tf.Tensor:
        with tf.device(dst):
            return tf.identity(x.read_value())[0]

    @tf.function
    def copy() -> tf.Tensor:
        with tf.device(devices[0]):
            return (x.read_value() + 1.0)[0]

    nbytes = n * 4
    out = {"bytes": nbytes, "cross_device_identity": nbytes / _median(cross, 2, 10),
           "memory_copy": nbytes / _median(copy, 2, 10)}
    out["used"] = "cross_device_identity" if "GPU" in devices[0].upper() else "memory_copy"
    return out


def _plan_summary(plan: PipelinePlan) -> dict:
    return {"method": plan.method, "bottleneck_s": plan.bottleneck_s,
            "stages": [{"layers": [s.first_layer, s.last_layer], "devices": list(s.devices)}
                       for s in plan.stages]}


def _sim(profile: ModelProfile, topology: Topology, plan: PipelinePlan, micro: int,
         micro_size: int) -> dict:
    sim = simulate_pipeline(profile, topology, plan, micro, micro_batch_size=micro_size)
    return {"makespan_s": sim["makespan_s"],
            "throughput_samples_per_s": sim["throughput_samples_per_s"]}


def host_section(model_name: str, image_size: int, batch: int, micro_batches: int,
                 warmup_steps: int, steps: int, profile_warmup: int, profile_repeats: int,
                 bandwidth_mib: float) -> dict:
    """Profile, plan, run and predict the host pipeline (see the module docstring)."""
    if batch % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} must divide batch={batch}")
    micro = batch // micro_batches
    model = build_model(model_name, (image_size, image_size, 3), 10, seed=0)
    t0 = time.perf_counter()
    profile = profile_model(model, batch_size=micro, warmup=profile_warmup,
                            repeats=profile_repeats)
    profile_s = time.perf_counter() - t0
    devices = [d.name for d in (tf.config.list_logical_devices("GPU")
                                or tf.config.list_logical_devices("CPU"))]
    bandwidth = measure_bandwidth(devices, bandwidth_mib)
    topology = Topology.homogeneous(len(devices), bandwidth[bandwidth["used"]])
    plans = {"bandwidth_dp": plan_pipeline(profile, topology),
             "oblivious": plan_oblivious(profile, topology),
             "single_device": make_plan(profile, topology,
                                        [(0, profile.num_layers - 1, (0,))], "single_device")}
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, image_size, image_size, 3)), tf.float32)
    y = tf.constant(rng.integers(0, 10, batch), tf.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = {}
    for name, plan in plans.items():
        trainer = PipelineTrainer(model, plan.stages, loss, keras.optimizers.SGD(0.01),
                                  micro_batches, devices)
        measured = _median(lambda t=trainer: t.train_step(x, y), warmup_steps, steps)
        predicted = _sim(profile, topology, plan, micro_batches, micro)
        runs[name] = {"plan": _plan_summary(plan), "predicted": predicted,
                      "measured_step_s": measured,
                      "measured_over_predicted": measured / predicted["makespan_s"]}
    return {"model": model_name, "image_size": image_size, "batch": batch,
            "micro_batches": micro_batches, "devices": devices,
            "profile": {"layers": [lp.to_dict() for lp in profile.layers],
                        "total_compute_s": profile.total_compute_s, "seconds": profile_s},
            "bandwidth_bytes_per_s": bandwidth, "runs": runs}


def simulated_section(models: list[str], image_size: int, batch: int, repeats: int,
                      devices: int, base_bandwidth: float, spread: float, seed: int,
                      micro_batches: int) -> dict:
    """Profiles the big models and compares the three planners' simulated throughput."""
    topology = Topology.random_heterogeneous(devices, base_bandwidth, spread, seed=seed)
    out = {"topology": {"devices": devices, "base_bandwidth": base_bandwidth, "spread": spread,
                        "seed": seed, "min_bandwidth": topology.min_bandwidth(),
                        "mean_bandwidth": topology.mean_bandwidth()}}
    for name in models:
        if name not in BIG_MODELS:
            raise ValueError(f"big_models: unknown {name!r}; choose from {sorted(BIG_MODELS)}")
        model = BIG_MODELS[name](weights=None, input_shape=(image_size, image_size, 3),
                                 classes=10)
        t0 = time.perf_counter()
        profile = profile_model(model, batch_size=batch, warmup=1, repeats=repeats,
                                allow_non_chain=True)
        entry = {"layers": profile.num_layers, "total_compute_s": profile.total_compute_s,
                 "param_bytes": profile.total_param_bytes,
                 "profile_seconds": time.perf_counter() - t0, "plans": {}}
        for method, planner in PLANNERS.items():
            plan = planner(profile, topology)
            entry["plans"][method] = {**_plan_summary(plan), **_sim(
                profile, topology, plan, micro_batches, batch)}
        best = entry["plans"]["bandwidth_dp"]["throughput_samples_per_s"]
        entry["speedup_of_bandwidth_dp"] = {
            m: best / p["throughput_samples_per_s"] for m, p in entry["plans"].items()}
        out[name] = entry
        del model
        keras.backend.clear_session()
    return out


def planning_time_section(layers: int, devices: int, base_bandwidth: float,
                          spread: float) -> dict:
    """Seconds of each planner on a random profile."""
    profile = random_profile(layers, seed=0)
    topology = Topology.random_heterogeneous(devices, base_bandwidth, spread, seed=0)
    out = {"layers": layers, "devices": devices}
    for method, planner in PLANNERS.items():
        t0 = time.perf_counter()
        planner(profile, topology)
        out[f"{method}_s"] = time.perf_counter() - t0
    return out


def run(**kw: Any) -> dict:
    """All three sections (keyword arguments are the flags' values)."""
    t0 = time.perf_counter()
    host = host_section(kw["model"], kw["image_size"], kw["batch"], kw["micro_batches"],
                        kw["warmup_steps"], kw["steps"], kw["profile_warmup"],
                        kw["profile_repeats"], kw["bandwidth_mib"])
    t1 = time.perf_counter()
    sim = simulated_section(kw["big_models"], kw["big_image_size"], kw["big_batch"],
                            kw["big_repeats"], kw["sim_devices"], kw["base_bandwidth"],
                            kw["spread"], kw["topology_seed"], kw["sim_micro_batches"])
    t2 = time.perf_counter()
    planning = planning_time_section(kw["plan_layers"], kw["plan_devices"],
                                     kw["base_bandwidth"], kw["spread"])
    return {"host": host, "simulated": sim, "planning_time": planning,
            "section_seconds": {"host": t1 - t0, "simulated": t2 - t1,
                                "planning_time": time.perf_counter() - t2},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "tensorflow": tf.__version__, "keras": keras.__version__,
                        "gpus": len(tf.config.list_physical_devices("GPU"))}}
