"""Hybrid conv/FC training benchmark: the FC head offloaded to host memory vs on the device.

    python -m launch.bench_hybrid [--device_memory_budget=32] [--fc_units=1024] [--steps=8]

``vgg_fc`` (``--image_size`` x ``--image_size`` x 1, ``--fc_units``-wide head; with the defaults
the head holds ~98% of the parameters) is split at its conv/FC boundary and profiled layer by
layer at the global batch (:func:`~tf_blocksparse.pipeline.profiler.measure_layers`).  The placement
planner gets a per-device budget of ``--device_memory_budget`` MiB, smaller than what the head
needs on the device (weights, gradients, momentum), and offloads head layers to host memory
(the expanded-memory emulation).  Then :class:`~tf_blocksparse.HybridTrainer`
trains on synthetic data in three configurations, each timed (median of ``--steps`` steps after
``--warmup_steps``):

``offloaded``
    the planner's placement (its expanded layers keep variables and optimizer state on the host
    device);
``all_on_device``
    nothing offloaded.  It is over the configured budget (that is the point), but the budget is
    an emulation: when the physical device has room it runs, for the step-time comparison
    (``fits_budget`` says so);
``offloaded_block_sparse``
    the planner's placement with block-sparse exchange in both groups (``--density``).

Memory: ``tf.config.experimental.get_memory_info`` (current / peak bytes, peak reset before
each configuration) of every device used, where TF supports it.  On GPUs it is per device.  On
CPUs TF either raises (reported as unsupported) or, as in TF 2.21, reports the one CPU allocator
that every logical CPU shares (reported once, as ``cpu_allocator``); either way it cannot say
which logical device holds what, so the planner's byte accounting per replica
(``planned_bytes``) and the bytes of the variables the trainer placed on each device
(``variable_bytes_by_device``) are the per-device figures.  Prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
from typing import Any

from absl import app, flags

from launch import script

FLAGS = flags.FLAGS
MIB = 2**20


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_integer("image_size", 28, "Input height/width (one channel).", lower_bound=8)
    flags.DEFINE_integer("fc_units", 1024, "Width of vgg_fc's fc1 and fc2.", lower_bound=1)
    flags.DEFINE_integer("batch", 32, "Global mini-batch size.", lower_bound=1)
    flags.DEFINE_integer("conv_replicas", 2, "I: conv replicas.", lower_bound=1)
    flags.DEFINE_integer("fc_replicas", 1, "J: FC replicas.", lower_bound=1)
    flags.DEFINE_float("device_memory_budget", 32.0, "MiB of one device for the planner.",
                       lower_bound=0.0)
    flags.DEFINE_float("expanded_memory_budget", 0.0, "MiB of one node's expanded memory "
                       "(0 = no limit).", lower_bound=0.0)
    flags.DEFINE_float("host_bandwidth", 25.0, "GB/s device <-> host memory (cost model).",
                       lower_bound=1e-9)
    flags.DEFINE_float("link_bandwidth", 12.5, "GB/s node-to-node (cost model).",
                       lower_bound=1e-9)
    flags.DEFINE_float("density", 0.01, "Block density of the block-sparse run.")
    flags.register_validator("density", lambda d: 0.0 < d <= 1.0, "--density must be in (0, 1]")
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps per configuration.", lower_bound=1)
    flags.DEFINE_integer("steps", 8, "Timed steps per configuration (median).", lower_bound=1)
    flags.DEFINE_integer("profile_repeats", 3, "Timed calls per profiled layer function.",
                         lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the model and the data.")


def memory_info(devices: list[str]) -> dict[str, Any]:
    """``get_memory_info`` per device, or why it is unavailable."""
    import tensorflow as tf

    out = {}
    for dev in devices:
        name = dev.lstrip("/").upper()
        try:
            out[dev] = dict(tf.config.experimental.get_memory_info(name))
        except (ValueError, RuntimeError, tf.errors.OpError) as err:
            out[dev] = {"supported": False, "error": str(err).splitlines()[0][:200]}
    return out


def reset_memory_stats(devices: list[str]) -> None:
    """Resets the peak counters where TF supports it."""
    import tensorflow as tf

    for dev in devices:
        try:
            tf.config.experimental.reset_memory_stats(dev.lstrip("/").upper())
        except (ValueError, RuntimeError, tf.errors.OpError):
            pass


def time_trainer(trainer: Any, batches: list, warmup: int) -> float:
    """Median seconds of ``trainer.train_step`` over ``batches[warmup:]``."""
    import tensorflow as tf

    for x, y in batches[:warmup]:
        trainer.train_step(x, y)
    tf.test.experimental.sync_devices()
    from launch import runtime

    return statistics.median(runtime.time_call(lambda x=x, y=y: trainer.train_step(x, y))
                             for x, y in batches[warmup:])


def run(f: Any = FLAGS) -> dict[str, Any]:
    """Runs the benchmark; returns (and prints) the JSON record."""
    from launch.hybrid_setup import hybrid_devices

    devices = hybrid_devices(f.conv_replicas, f.fc_replicas)
    import keras
    import numpy as np
    import tensorflow as tf

    from models import registry
    from models.vgg import head_fraction
    from tf_blocksparse.hybrid import MemoryBudget, evaluate_placement, plan_placement
    from tf_blocksparse.hybrid.split import layer_memory
    from tf_blocksparse.hybrid.trainer import HybridTrainer
    from tf_blocksparse.pipeline.profiler import measure_layers

    shape = (f.image_size, f.image_size, 1)

    def build() -> keras.Model:
        return registry.build_model("vgg_fc", shape, 10, fc_units=f.fc_units, seed=f.seed)

    model = build()
    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    compute = {m.name: m.compute_s for m in measure_layers(
        model, batch_size=f.batch, warmup=1, repeats=f.profile_repeats)}
    layers = layer_memory(model, None, f.batch, sgd, compute)
    device_budget = f.device_memory_budget * MIB if f.device_memory_budget else math.inf
    expanded_budget = f.expanded_memory_budget * MIB if f.expanded_memory_budget else math.inf
    bw = (f.host_bandwidth * 1e9, f.link_bandwidth * 1e9)
    budget = MemoryBudget(device_budget, expanded_budget, *bw)
    plan = plan_placement(layers, device_budget, expanded_budget, *bw, f.conv_replicas,
                          f.fc_replicas)
    on_device = evaluate_placement(layers, [], budget, f.conv_replicas, f.fc_replicas)
    rng = np.random.default_rng(f.seed)
    batches = [(rng.random((f.batch, *shape), dtype=np.float32),
                rng.integers(0, 10, f.batch).astype("int32"))
               for _ in range(f.warmup_steps + f.steps)]
    used = sorted({*devices["conv"], *devices["fc"], devices["host"]})
    configs = {"offloaded": (plan, None), "all_on_device": (on_device, None),
               "offloaded_block_sparse": (plan, {"density": f.density})}
    runs = {}
    for name, (chosen, compression) in configs.items():
        reset_memory_stats(used)
        trainer = HybridTrainer(build(), devices["conv"], devices["fc"], sgd,
                                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                host_device=devices["host"], compression=compression,
                                offload=chosen.expanded_layers)
        step = time_trainer(trainer, batches, f.warmup_steps)
        placement = trainer.placement()
        runs[name] = {
            "step_time_s": step, "predicted_step_time_s": chosen.step_time_s,
            "fits_budget": chosen.fits, "expanded_layers": list(chosen.expanded_layers),
            "fc_variable_devices": sorted({d.split("device:")[-1] for r in placement["fc"]
                                           for d in r["variables"].values()}),
            "fc_optimizer_state_devices": sorted({
                d.split("device:")[-1] for r in placement["fc"]
                for d in r["optimizer_slots"].values()}),
            "planned_bytes": {g: dict(chosen.group_bytes[g]) for g in ("conv", "fc")},
            "variable_bytes_by_device": {d.split("device:")[-1]: n for d, n in
                                         trainer.variable_bytes_by_device().items()},
            "memory_info": memory_info(used),
            "exchange_bytes_per_replica": {g: trainer.syncs[g].nbytes()
                                           for g in ("conv", "fc")},
        }
        if not tf.config.list_physical_devices("GPU"):
            info = runs[name].pop("memory_info")
            runs[name]["memory_info"] = {"cpu_allocator": next(iter(info.values()))}
        del trainer
        gc.collect()
    gpu = bool(tf.config.list_physical_devices("GPU"))
    supported = gpu and all(v.get("supported", True)
                            for v in runs["offloaded"]["memory_info"].values())
    head = [x for x in layers if x.is_fc]
    record = {
        "device_kind": "GPU" if tf.config.list_physical_devices("GPU") else "CPU",
        "devices": devices, "model": "vgg_fc", "input_shape": list(shape),
        "fc_units": f.fc_units, "batch": f.batch, "conv_replicas": f.conv_replicas,
        "fc_replicas": f.fc_replicas, "head_param_fraction": head_fraction(model),
        "head_resident_bytes": sum(x.resident_bytes for x in head),
        "device_budget_bytes": None if math.isinf(device_budget) else device_budget,
        "plan": plan.to_dict(),
        "all_on_device_fits_budget": on_device.fits,
        "runs": runs,
        "offloaded_over_all_on_device_time": runs["offloaded"]["step_time_s"]
        / runs["all_on_device"]["step_time_s"],
        "per_device_memory_info": supported,
        "memory_source": "tf.config.experimental.get_memory_info per device" if supported else
        "planner byte accounting and variable bytes per device (get_memory_info gives no "
        "per-device figures here: unsupported, or one allocator shared by the logical CPUs)",
    }
    if record["device_kind"] == "CPU":
        record["note"] = ("logical CPUs share one physical memory: the host device and the "
                          "compute devices are the same RAM, so offloading changes placement "
                          "and data movement, not capacity")
    print(json.dumps(record))
    return record


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run()


if __name__ == "__main__":
    script.run(main, define_flags)
