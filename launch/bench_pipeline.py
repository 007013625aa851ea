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

from absl import flags

from launch import script

FLAGS = flags.FLAGS


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


def main(argv: list[str]) -> None:
    """Prints :func:`launch.benches.pipeline.run`'s record for the flags as one JSON object."""
    del argv
    from launch import runtime
    from launch.benches import pipeline

    runtime.logical_cpus(FLAGS.logical_devices, skip_on_gpu=True)
    names = ("model", "image_size", "batch", "micro_batches", "warmup_steps", "steps",
             "profile_warmup", "profile_repeats", "bandwidth_mib", "big_image_size",
             "big_batch", "big_repeats", "sim_devices", "base_bandwidth", "spread",
             "topology_seed", "sim_micro_batches", "plan_layers", "plan_devices")
    kw = {n: getattr(FLAGS, n) for n in names}
    kw["big_models"] = [m for m in FLAGS.big_models if m]
    print(json.dumps(pipeline.run(**kw)))


if __name__ == "__main__":
    script.run(main, define_flags)
