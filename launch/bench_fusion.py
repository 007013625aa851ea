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

import json

from absl import flags

from launch import script

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


def main(argv: list[str]) -> None:
    """Prints :func:`launch.benches.fusion.run`'s record for the flags as one JSON object."""
    del argv
    from launch import runtime
    from launch.benches import fusion

    runtime.logical_cpus(2)
    print(json.dumps(fusion.run(
        buffer_mib=[float(m) for m in FLAGS.buffer_mib], plan_models=FLAGS.plan_models,
        sim_model=FLAGS.sim_model, sim_image_size=FLAGS.sim_image_size,
        sim_batch=FLAGS.sim_batch, sim_warmup=FLAGS.sim_warmup, sim_steps=FLAGS.sim_steps,
        cycle_ms=FLAGS.cycle_ms, sim_buffer_divisor=FLAGS.sim_buffer_divisor,
        step_model=FLAGS.step_model, step_image_size=FLAGS.step_image_size,
        step_batch=FLAGS.step_batch, warmup=FLAGS.warmup, repeats=FLAGS.repeats,
        pack_mib=FLAGS.pack_mib, sections=FLAGS.sections)))


if __name__ == "__main__":
    script.run(main, define_flags)
