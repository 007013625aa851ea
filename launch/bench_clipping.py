"""Layer-wise local clipping before a per-group exchange: overlap with backward, and step time.

Everything runs in one process on one ``MirroredStrategy(["/cpu:0", "/cpu:1"])`` (two logical
CPUs: TF gives every instance the same collective keys, so a second instance that runs
collectives would clash).  Every variant has its own copy of the model (identical initial
weights), its own optimizer (built under the strategy before tracing) and the same
``tf.function`` step::

    strategy.run(replica_fn):  forward, loss / replicas, tape.gradient,
                               optimizer.apply(grads, variables)

on the same fixed random batch (``--batch`` per replica).  The inner optimizer is always
``SGD(0.05, momentum=0.9)``.  Prints one JSON object with:

``overlap``
    A TF profiler trace (``tf.profiler.experimental``; host tracer only) of ``--trace_steps``
    steps of ``BlockSparseOptimizer(SGD, k=1, exchange="allgather",
    clipping=[LocalNormClip(--threshold)])`` with ``fusion_buffer_bytes=--buffer_bytes``
    (``fused``: one set of collectives per balanced group) and with ``None``
    (``single_group``: every collective waits for the last gradient).  Each step is its own
    profiler session; its ``*.xplane.pb`` is parsed with ``xplane_pb2``: on the ``/host:CPU``
    plane an executed TF op is an event whose metadata name is ``"<op name>:<op type>"``
    (the metadata's display name is the type); events lie on per-thread lines
    (``tf_Compute/...`` for kernels, ``collective_ops/...`` for collective kernels) at
    ``line.timestamp_ns * 1000 + offset_ps``.  Every op is assigned to a replica by its
    device in the traced step's graph (fallback: a ``replica_<i>/`` name scope, else left
    out).  Per replica:

    - *backward ops*: ops with a ``gradient_tape`` / ``gradients`` name-scope component, or
      of a backprop type (type containing ``Backprop`` or ending in ``Grad``, e.g.
      ``_MklNativeConv2DBackpropFilter``, ``ReluGrad``, ``FusedBatchNormGradV3``); the
      *backward window* runs from the first one's start to the last one's end;
    - *exchange*: the collective kernels (type starting with ``Collective`` or ``Nccl``,
      except ``CollectiveAssignGroupV2`` / ``CollectiveInitializeCommunicator``).  A kernel's
      event runs from its launch on that replica (after parameter resolution) to its
      completion, so it includes waiting for the other replica;
    - ``exchange_overlap_fraction`` = length of (union of the replica's exchange intervals
      intersected with its backward window) / length of that union, pooled over replicas
      (sum of the numerators / sum of the denominators).  Also the exchange's tail after
      the backward window (last collective end - backward end, at least 0) and the first
      collective's start minus the backward end (negative: launched while backward ran);
    - ``joint_exchange_overlap_fraction``: the same without waiting for the peer: each
      collective instance (``instance_key`` stat) counts from its launch on the *last*
      replica to its last completion, against the window from the first backward op of
      any replica to the last one of any replica.

    Per variant the per-step figures and their medians are reported, plus the op types of
    the collectives seen and their number per replica.  A step whose trace misses an event
    of some collective instance (the host tracer can drop one) is traced again, up to three
    profiler sessions; ``trace_attempts`` holds the sessions per step, and
    ``unmatched_instances`` / ``unkeyed_collectives`` are 0 for a complete trace.

    Scheduling caveat (seen in these traces): with TF's default inter-op pool (one thread
    per core; 2 here) the executor runs the input-gradient chain depth-first and
    leaves many weight-gradient ops (e.g. the logits' ``BiasAddGrad``, the second conv of
    each residual block) queued until the chain reaches the first layer, so the first fusion
    group's gradients are only complete at the very end of the backward and the per-group
    exchange barely overlaps.  ``--inter_op_threads`` (e.g. 8) makes those ops run as soon
    as they are ready, and the groups' collectives then interleave with the backward.
``step_time``
    Median wall time of one step (``.numpy()`` of the summed loss), the variants run
    interleaved (A B C D E A B C D E ...) after ``--warmup`` untimed rounds:

    - ``local_clip_dense``: ``BlockSparseOptimizer(SGD, exchange="dense",
      clipping=LocalNormClip(t), fusion_buffer_bytes=B)`` (layer-wise local clipping, then
      one dense all-reduce per group);
    - ``local_clip_allgather``: the same with ``exchange="allgather", k=1`` (the ``fused``
      variant above);
    - ``global_clipnorm``: ``SGD(..., global_clipnorm=t)``.  Keras 3 (TF backend) clips in
      ``apply`` *before* ``_backend_update_step`` all-reduces, so under a strategy this
      clips the global norm of each replica's *local* (1 / replicas scaled) gradients; a
      global norm needs every gradient, so the one batched all-reduce waits for the whole
      backward either way;
    - ``no_clip``: plain ``SGD``;
    - ``reduce_then_global_clip``: ``SGD`` that clips the global norm of the *all-reduced*
      gradients (its ``_all_reduce_sum_gradients`` hook reduces, then clips), i.e. clipping
      after aggregation.

    Ratios are against ``global_clipnorm``.

    python -m launch.bench_clipping [--model=resnet20] [--batch=16] [--repeats=15]
        [--inter_op_threads=8] [--logdir=/tmp/trace]
"""

from __future__ import annotations

import json

from absl import flags

from launch import script

FLAGS = flags.FLAGS
MODELS = ("resnet20", "cnn_bn")


def define_flags() -> None:
    """Defines the script's flags (only called when run as a script)."""
    flags.DEFINE_enum("model", "resnet20", MODELS,
                      "Registry model: resnet20 or cnn_bn (4 conv-BN blocks + dense head).")
    flags.DEFINE_integer("image_size", 32, "Input height / width.")
    flags.DEFINE_integer("batch", 16, "Batch size per replica.")
    flags.DEFINE_integer("warmup", 3, "Untimed interleaved rounds before the timed ones.")
    flags.DEFINE_integer("repeats", 15, "Timed interleaved rounds (median).", lower_bound=1)
    flags.DEFINE_integer("trace_steps", 3, "Profiled steps per overlap variant (median).",
                         lower_bound=1)
    flags.DEFINE_integer("buffer_bytes", 0,
                         "Fusion buffer in bytes; 0: a quarter of the model's gradient bytes.")
    flags.DEFINE_float("threshold", 1.0, "Clipping threshold t (LocalNormClip, global norm).")
    flags.DEFINE_integer("inter_op_threads", 0,
                         "TF inter-op threads (set before TF initialises); 0: TF's default.")
    flags.DEFINE_string("logdir", "", "Profiler log directory (kept); default a temporary "
                                      "directory, removed at the end.")


def main(argv: list[str]) -> None:
    """Prints :func:`launch.benches.clipping.run`'s record for the flags as one JSON object."""
    del argv
    import tensorflow as tf

    from launch import runtime
    from launch.benches import clipping

    if FLAGS.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    runtime.logical_cpus(2)
    print(json.dumps(clipping.run(
        model=FLAGS.model, image_size=FLAGS.image_size, batch=FLAGS.batch,
        warmup=FLAGS.warmup, repeats=FLAGS.repeats, trace_steps=FLAGS.trace_steps,
        buffer_bytes=FLAGS.buffer_bytes, threshold=FLAGS.threshold, logdir=FLAGS.logdir)))


if __name__ == "__main__":
    script.run(main, define_flags)
