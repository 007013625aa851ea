"""Hybrid conv/FC training with the FC group in (emulated) expanded memory.

    python -m launch.train_hybrid --model=vgg_fc --dataset=digits --conv_replicas=2 \\
        --fc_replicas=1 --steps=5 --device_memory_budget=2 --verify_against_data_parallel

The model is split at its conv/FC boundary (or at ``--split_layer``, the first head layer);
``--conv_replicas`` replicas train the trunk and ``--fc_replicas`` replicas the head
(:class:`~tf_blocksparse.hybrid.trainer.HybridTrainer`).  The placement planner
(:func:`~tf_blocksparse.hybrid.plan_placement`) decides from
``--device_memory_budget`` / ``--expanded_memory_budget`` (MiB per device / per node, 0 = no
limit) which layers keep their variables and optimizer state in host memory (``--offload=plan``;
``fc`` always offloads the head, ``none`` never).  Devices: on a GPU host the replicas share the
GPUs round-robin and the host memory is ``/cpu:0``; on a CPU host ``I + J + 1`` logical CPUs are
made (conv replicas, FC replicas, host memory).

``--verify_against_data_parallel`` trains a copy of the model on the same global batches with
plain data parallelism (``MirroredStrategy`` over the conv replicas' devices, a custom loop,
the same SGD) and reports ``max_abs_weight_diff``.  With ``--compression=block`` in both groups
and ``I == J`` the reference uses ``BlockSparseCrossDeviceOps`` with the same settings (the
same per-replica selections, so the difference is again float rounding); otherwise the
reference is dense and the difference shows the compression's effect.

Prints one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from launch import script
from launch.flags import define_flags as define_shared_flags
from launch.hybrid_setup import (
    cluster_devices,
    global_batches,
    group_summary,
    hybrid_devices,
    parse_workers,
    short_device,
    train_data_parallel,
)

FLAGS = flags.FLAGS
MIB = 2**20
#: Environment variable: the workers' idle resident bytes (JSON list), set by the launcher.
IDLE_ENV = "TFBS_IDLE_RSS"


def define_flags() -> None:
    """Defines the shared training flags and the hybrid ones (only called as a script)."""
    define_shared_flags(flag_values=FLAGS)
    FLAGS.set_default("compression", "dense")
    FLAGS.set_default("model", "vgg_fc")
    flags.DEFINE_integer("conv_replicas", 2, "I: data-parallel replicas of the conv trunk.",
                         lower_bound=1)
    flags.DEFINE_integer("fc_replicas", 1, "J: data-parallel replicas of the FC head.",
                         lower_bound=1)
    flags.DEFINE_float("device_memory_budget", 0.0, "MiB of one device's memory for the "
                       "planner (0 = no limit).", lower_bound=0.0)
    flags.DEFINE_float("expanded_memory_budget", 0.0, "MiB of one node's expanded (host) "
                       "memory for the planner (0 = no limit).", lower_bound=0.0)
    flags.DEFINE_float("host_bandwidth", 25.0, "GB/s between a device and host/expanded "
                       "memory (cost model).", lower_bound=1e-9)
    flags.DEFINE_float("link_bandwidth", 12.5, "GB/s of a node-to-node link (cost model).",
                       lower_bound=1e-9)
    flags.DEFINE_enum("offload", "plan", ["plan", "fc", "none"], "Which layers keep their state "
                      "in host memory: the planner's choice, the whole FC head, or none.")
    flags.DEFINE_string("split_layer", None, "First layer of the head (default: the first "
                        "Dense after the last convolution).")
    flags.DEFINE_enum("compression_groups", "both", ["both", "conv", "fc"],
                      "Groups that use --compression=block.")
    flags.DEFINE_integer("fc_units", 0, "vgg_fc head width (0 = the builder's default).",
                         lower_bound=0)
    flags.DEFINE_integer("steps", 5, "Training steps.", lower_bound=1)
    flags.DEFINE_string("host_device", "", "Device of the expanded-memory state (default "
                        "/cpu:0 on GPU hosts, the last logical CPU otherwise).")
    flags.DEFINE_boolean("profile_layers", False, "Time every layer at the global batch size "
                         "(chain or functional models) so the cost model includes compute.")
    flags.DEFINE_boolean("verify_against_data_parallel", False, "Also train with plain data "
                         "parallelism on the same batches and report max_abs_weight_diff.")
    flags.DEFINE_string("workers", None, "I+J (e.g. 2+1): run on an emulated cluster of I "
                        "conv worker processes and J FC worker processes whose memory holds "
                        "the FC state (each in its own network namespace; needs root). "
                        "Overrides --conv_replicas / --fc_replicas. Default: one process with "
                        "logical devices.")
    flags.DEFINE_integer("conv_worker_memory_mib", 0, "--workers: memory cap of every conv "
                         "worker process (MiB, 0 = none).", lower_bound=0)
    flags.DEFINE_integer("fc_state_task", -1, "--workers: the worker task whose memory holds "
                         "the FC state (-1: the first FC worker). A conv worker's task shows "
                         "what its memory cap prevents.", lower_bound=-1)
    flags.DEFINE_boolean("check_memory", True, "--workers: refuse to start when the FC state "
                         "cannot fit the memory cap of the worker chosen to hold it (else the "
                         "kernel's out-of-memory killer stops the run).")
    flags.DEFINE_float("bandwidth_mbit", None, "--workers: shape every link between workers "
                       "to this rate (Mbit/s).")
    flags.DEFINE_string("out", None, "Also write the record to OUT/hybrid_cluster.json "
                        "(--workers) or OUT/hybrid.json.")
    flags.register_validator("workers", lambda v: v is None or parse_workers(v) is not None,
                             "--workers must be I+J with I, J >= 1, e.g. 2+1")


def compression_specs(f: Any) -> tuple[dict | None, dict | None]:
    """``(trainer compression argument, shared spec)`` from the flags."""
    if f.compression == "dense":
        return None, None
    if f.compression != "block":
        raise app.UsageError("train_hybrid.py supports --compression=dense or block")
    spec = {"k": f.k, "density": f.density, "metric": f.metric}
    if spec["k"] is None and spec["density"] is None:
        spec["k"] = 1
    if f.compression_groups == "both":
        return spec, spec
    return {f.compression_groups: spec}, None


def group_specs(comp: dict | None) -> dict[str, dict | None]:
    """The dict spec of each group (``None``: dense), as the JSON record keeps it; the
    trainer converts them once to ``CompressionOptions``."""
    if comp and set(comp) <= {"conv", "fc"}:
        return {g: comp.get(g) for g in ("conv", "fc")}
    return {"conv": comp, "fc": comp}


def run(f: Any = FLAGS) -> dict[str, Any]:
    """Trains as the flags say; returns (and prints) the JSON record."""
    cluster = parse_workers(f.workers) if f.workers else None
    if cluster:
        if f.offload == "none":
            raise app.UsageError("--workers keeps the FC state in the FC worker's memory: "
                                 "--offload=none does not apply")
        f.offload = "fc"  # every head layer's state on the worker --fc_state_task names
        f.conv_replicas, f.fc_replicas = cluster
        devices = cluster_devices(*cluster, f.fc_state_task)
    else:
        devices = hybrid_devices(f.conv_replicas, f.fc_replicas, f.host_device)
    import keras
    import numpy as np

    from launch import inputs
    from models import registry
    from tf_blocksparse.hybrid import MemoryBudget, evaluate_placement, plan_placement
    from tf_blocksparse.hybrid.split import layer_memory
    from tf_blocksparse.hybrid.trainer import HybridTrainer

    arrays = inputs.load_arrays(f.dataset, f.model, f.data_dir, f.tfds_data_dir,
                                  f.synthetic_shape, f.train_samples, f.seed)
    extra = {"fc_units": f.fc_units} if f.fc_units and f.model == "vgg_fc" else {}

    def build() -> keras.Model:
        return registry.build_model(f.model, arrays.input_shape, arrays.num_classes,
                                    seed=f.seed, **extra)

    model = build()
    initial = model.get_weights()
    sgd = keras.optimizers.SGD(f.lr, momentum=f.momentum)
    mib = {"device": f.device_memory_budget, "expanded": f.expanded_memory_budget}
    budgets = {k: v * MIB if v else math.inf for k, v in mib.items()}
    compute_s = None
    if f.profile_layers:
        from tf_blocksparse.pipeline.profiler import measure_layers

        compute_s = {m.name: m.compute_s for m in measure_layers(
            model, batch_size=f.batch_size, allow_non_chain=True, warmup=1, repeats=3)}
    layers = layer_memory(model, f.split_layer, f.batch_size, sgd, compute_s)
    bw = (f.host_bandwidth * 1e9, f.link_bandwidth * 1e9)
    if f.offload == "none":
        plan = evaluate_placement(layers, [], MemoryBudget(budgets["device"],
                                  budgets["expanded"], *bw), f.conv_replicas, f.fc_replicas)
    else:
        plan = plan_placement(layers, budgets["device"], budgets["expanded"], *bw,
                              f.conv_replicas, f.fc_replicas,
                              offload_fc_group=f.offload == "fc")
    comp, shared = compression_specs(f)
    if cluster:
        fc_state = check_fc_state(f, layers, plan, comp, devices["fc_state_task"])
    trainer = HybridTrainer(model, devices["conv"], devices["fc"], sgd,
                            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            boundary=f.split_layer, host_device=devices["host"],
                            compression=comp, offload=plan)
    batches = global_batches(arrays.train[0], arrays.train[1], f.batch_size, f.steps, f.seed)
    losses, times = [], []
    for x, y in batches:
        start = time.perf_counter()
        losses.append(float(trainer.train_step(x, y)))
        times.append(time.perf_counter() - start)
    trainer.copy_to_model()
    record: dict[str, Any] = {
        "model": f.model, "dataset": arrays.name, "conv_replicas": f.conv_replicas,
        "fc_replicas": f.fc_replicas, "batch_size": f.batch_size, "steps": f.steps,
        "boundary": trainer.placement()["boundary"],
        "compression": group_specs(comp),
        "exchange_bytes_per_replica": {g: trainer.syncs[g].nbytes() for g in ("conv", "fc")},
        "loss_first": losses[0], "loss_last": losses[-1],
        "step_time_s_median": statistics.median(times[1:] or times),
        "predicted_step_time_s": plan.step_time_s, "predicted_breakdown_s": plan.breakdown,
        "layers_profiled": bool(f.profile_layers), "plan_fits": plan.fits,
        "memory_placement": group_summary(trainer.placement(), plan),
        "variable_bytes_by_device": {short_device(d): n for d, n in
                                     trainer.variable_bytes_by_device().items()},
    }
    if cluster:
        record.update(cluster_facts(f, trainer, devices, fc_state))
    if f.verify_against_data_parallel:
        exact = comp is None or (shared is not None and f.conv_replicas == f.fc_replicas)
        want = train_data_parallel(build, initial, batches, devices["reference"], f.lr,
                                   f.momentum, shared if exact else None)
        record["max_abs_weight_diff"] = max(float(np.max(np.abs(a - b)))
                                            for a, b in zip(model.get_weights(), want))
        record["reference"] = (("data parallel, same block-sparse exchange" if comp else
                                "data parallel, dense") if exact else
                               "dense data parallel (the difference includes the compression)")
        record["reference_devices"] = devices["reference"]
    print(json.dumps(record))
    if f.out:
        os.makedirs(f.out, exist_ok=True)
        name = "hybrid_cluster.json" if cluster else "hybrid.json"
        with open(os.path.join(f.out, name), "w") as fh:
            json.dump(record, fh, indent=1)
    return record


def check_fc_state(f: Any, layers: Sequence[Any], plan: Any, comp: Any, task: int) -> int:
    """Planned bytes of the FC state on worker ``task``; refuses (``--check_memory``) when that
    worker is a capped conv worker whose idle footprint plus this state exceeds its cap."""
    fc_state = sum(x.resident_bytes for x in layers if x.is_fc and
                   x.name in plan.expanded_layers)
    if comp is not None and (not isinstance(comp, dict) or comp.get("fc", comp) is not None):
        fc_state += sum(x.param_bytes for x in layers if x.is_fc and
                        x.name in plan.expanded_layers)  # the residuals
    idle = json.loads(os.environ.get(IDLE_ENV, "[]"))
    cap = f.conv_worker_memory_mib * MIB
    if f.check_memory and cap and task < f.conv_replicas and idle:
        need = idle[task] + fc_state
        if need > cap:
            raise MemoryError(
                f"--fc_state_task={task}: the FC state ({fc_state / MIB:.0f} MiB planned: "
                f"variables, gradients, optimizer slots, residuals) does not fit conv "
                f"worker {task}'s memory cap (--conv_worker_memory_mib="
                f"{f.conv_worker_memory_mib}) beside its idle footprint of "
                f"{idle[task] / MIB:.0f} MiB; put it on an FC worker (--fc_state_task=-1) or "
                "raise the cap")
    return fc_state


def cluster_facts(f: Any, trainer: Any, devices: dict[str, Any], fc_state: int) -> dict:
    """The emulated cluster's part of the record."""
    by_device = trainer.variable_bytes_by_device()
    idle = json.loads(os.environ.get(IDLE_ENV, "[]"))
    return {"workers": f.workers, "conv_tasks": list(range(f.conv_replicas)),
            "fc_tasks": list(range(f.conv_replicas, f.conv_replicas + f.fc_replicas)),
            "fc_state_task": devices["fc_state_task"],
            "fc_state_bytes": int(by_device.get(devices["host"], 0)),
            "fc_state_planned_bytes": int(fc_state),
            "conv_worker_memory_mib": f.conv_worker_memory_mib,
            "conv_worker_idle_bytes": idle[:f.conv_replicas],
            "bandwidth_mbit": f.bandwidth_mbit}


def launch_cluster(f: Any) -> int:
    """Starts the I + J worker servers (conv workers capped) and re-runs this script as the
    client inside the cluster; returns its exit code."""
    if os.geteuid() != 0:
        print("train_hybrid: --workers needs root (network namespaces, cgroups); run it as "
              "root or drop --workers", file=sys.stderr)
        return 1
    from launch.cluster.tf_cluster import ServerCluster, WorkerFailure

    conv, fc = parse_workers(f.workers)
    n = conv + fc
    rates = [[f.bandwidth_mbit] * n for _ in range(n)] if f.bandwidth_mbit else None
    memory = [f.conv_worker_memory_mib or None] * conv + [None] * fc
    try:
        with ServerCluster(n, pair_mbit=rates, memory_mib=memory, namespaces=True) as cl:
            env = {IDLE_ENV: json.dumps(cl.idle_rss_bytes)}
            rc = cl.run_client([sys.executable, "-m", "launch.train_hybrid", *sys.argv[1:]],
                               env=env)
    except WorkerFailure as e:
        print(f"train_hybrid: {e}", file=sys.stderr)
        return 1
    return rc


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tf_blocksparse.runtime import remote

    if FLAGS.workers and remote.cluster_from_env() is None:
        return launch_cluster(FLAGS)
    try:
        run()
    except MemoryError as e:
        print(f"train_hybrid: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    script.run(main, define_flags)
