"""Pipeline training: host run of a planned pipeline, and simulated large-model plans.

Prints one JSON object with:

``host``
    A chain CNN (``--model`` from ``models/registry.py``) profiled layer by layer on this host
    at the micro-batch size (``--batch / --micro_batches``); a homogeneous
    :class:`~tf_blocksparse.planning.Topology` of the host's ``--logical_devices`` logical
    devices whose bandwidth is measured: on GPUs the time of a cross-device ``tf.identity`` of
    ``--bandwidth_mib`` MiB; on CPUs that identity is zero-copy (logical CPUs share memory, the
    figure is reported as ``cross_device_identity``), so the topology uses a same-memory copy
    (``x + 1`` into a fresh buffer: one read, one write).  The plan of
    :func:`~tf_blocksparse.planning.plan_pipeline` runs with
    :class:`~tf_blocksparse.pipeline.trainer.PipelineTrainer` (median ``train_step`` time
    over ``--steps`` after ``--warmup_steps``) next to the bandwidth-oblivious plan (one stage
    per device) and a one-stage one-device run of the same trainer, each beside the makespan
    :func:`~tf_blocksparse.planning.simulate_pipeline` predicts (GPipe schedule).  On a CPU
    host the logical devices share the same cores, so stages cannot really run side by side:
    measured and predicted times differ (see ``measured_over_predicted``).
``simulated``
    ``keras.applications`` ResNet-50 and VGG-16 (``weights=None``) profiled on this host at
    ``--big_image_size`` pixels and micro-batch ``--big_batch`` (non-chain graphs in topological
    order; a cut's activation bytes are all tensors live across it), planned on
    ``Topology.random_heterogeneous(--sim_devices, --base_bandwidth, --spread)`` by
    ``plan_pipeline`` (bandwidth-aware DP), ``plan_pipedream`` and ``plan_oblivious``, each
    simulated for ``--sim_micro_batches`` micro-batches (throughput in samples/s).
``planning_time``
    Seconds of each planner on a random ``--plan_layers``-layer profile and ``--plan_devices``
    heterogeneous devices.

    python -m launch.bench_pipeline [--logical_devices=2] [--big_models=resnet50,vgg16]
    python -m launch.bench_pipeline --big_models= --steps=3   # host part only, quick
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from launch import runtime, script
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

FLAGS = flags.FLAGS
MIB = 2**20
BIG_MODELS = {"resnet50": keras.applications.ResNet50, "vgg16": keras.applications.VGG16}
PLANNERS: dict[str, Callable[[ModelProfile, Topology], PipelinePlan]] = {
    "bandwidth_dp": plan_pipeline, "pipedream": plan_pipedream, "oblivious": plan_oblivious}


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_integer("logical_devices", 2, "Logical CPUs to configure (CPU hosts).",
                         lower_bound=1)
    flags.DEFINE_string("model", "cnn_small", "Registry model of the host run (a chain).")
    flags.DEFINE_integer("image_size", 32, "Input height/width of the host model.", lower_bound=1)
    flags.DEFINE_integer("batch", 32, "Mini-batch size of the host run.", lower_bound=1)
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per mini-batch.", lower_bound=1)
    flags.DEFINE_integer("warmup_steps", 2, "Untimed pipeline steps.", lower_bound=0)
    flags.DEFINE_integer("steps", 10, "Timed pipeline steps (median).", lower_bound=1)
    flags.DEFINE_integer("profile_warmup", 2, "Untimed calls per profiled layer function.",
                         lower_bound=0)
    flags.DEFINE_integer("profile_repeats", 5, "Timed calls per profiled layer function.",
                         lower_bound=1)
    flags.DEFINE_float("bandwidth_mib", 64.0, "Tensor size of the bandwidth measurement.")
    flags.register_validator("bandwidth_mib", lambda v: v > 0, "--bandwidth_mib must be > 0")
    flags.DEFINE_list("big_models", ["resnet50", "vgg16"], "Models of the simulated section.")
    flags.DEFINE_integer("big_image_size", 64, "Input height/width of the profiled big models.",
                         lower_bound=1)
    flags.DEFINE_integer("big_batch", 8, "Micro-batch size of the profiled big models.",
                         lower_bound=1)
    flags.DEFINE_integer("big_repeats", 3, "Timed calls per layer function (big models).",
                         lower_bound=1)
    flags.DEFINE_integer("sim_devices", 16, "Devices of the heterogeneous topology.", lower_bound=1)
    flags.DEFINE_float("base_bandwidth", 1.25e9, "Fastest link, bytes/s (10 Gb/s).")
    flags.register_validator("base_bandwidth", lambda v: v > 0, "--base_bandwidth must be > 0")
    flags.DEFINE_float("spread", 0.8, "Links uniform in [(1 - spread), 1] * base_bandwidth.")
    flags.register_validator("spread", lambda v: 0.0 <= v < 1.0, "--spread must be in [0, 1)")
    flags.DEFINE_integer("topology_seed", 0, "Seed of the heterogeneous topology.")
    flags.DEFINE_integer("sim_micro_batches", 16, "Micro-batches of the simulations.",
                         lower_bound=1)
    flags.DEFINE_integer("plan_layers", 200, "Layers of the planning-time profile.", lower_bound=1)
    flags.DEFINE_integer("plan_devices", 16, "Devices of the planning-time topology.",
                         lower_bound=1)


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


def main(argv: list[str]) -> None:
    """Prints :func:`run`'s record for the flags as one JSON object."""
    del argv
    runtime.logical_cpus(FLAGS.logical_devices, skip_on_gpu=True)
    names = ("model", "image_size", "batch", "micro_batches", "warmup_steps", "steps",
             "profile_warmup", "profile_repeats", "bandwidth_mib", "big_image_size",
             "big_batch", "big_repeats", "sim_devices", "base_bandwidth", "spread",
             "topology_seed", "sim_micro_batches", "plan_layers", "plan_devices")
    kw = {n: getattr(FLAGS, n) for n in names}
    kw["big_models"] = [m for m in FLAGS.big_models if m]
    print(json.dumps(run(**kw)))


if __name__ == "__main__":
    script.run(main, define_flags)
