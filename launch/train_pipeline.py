"""Pipeline training across worker processes on an emulated heterogeneous cluster.

    python -m launch.train_pipeline --workers=4 --topology=random --spread=0.8 \\
        --bandwidth_mbit=200 --model=vgg_fc --steps=10 --micro_batches=4 --out=/tmp/pipe

The launcher (this script, as root) starts ``--workers`` TensorFlow worker servers, each in
its own network namespace, with the link from worker ``i`` to worker ``j`` shaped to the
``--topology``'s rate (fastest link ``--bandwidth_mbit``) and a CPU quota of
``--worker_cpus`` CPUs per worker (:class:`launch.cluster.tf_cluster.ServerCluster`), and re-runs
itself as the *client* inside the cluster.  The client

1. connects to the workers (:func:`tf_blocksparse.runtime.remote.connect`);
2. profiles ``--model`` layer by layer at the micro-batch size under the same CPU quota;
3. plans with the bandwidth-aware DP (``plan_pipeline``), PipeDream (``plan_pipedream``) and
   the bandwidth-oblivious split (``plan_oblivious``) on the shaped rates;
4. trains each plan with :class:`~tf_blocksparse.PipelineTrainer` on the worker processes
   (stage ``s`` on the worker tasks of the plan) for ``--warmup_steps`` + ``--steps`` steps,
   all plans in this one run, on the same batches;
5. writes ``OUT/pipeline_cluster.json``: per plan ``measured_step_s`` (median),
   ``predicted_step_s`` (the cost model's GPipe makespan of one mini-batch),
   ``measured_over_predicted``, ``stages`` (layer range, worker tasks),
   ``throughput_samples_s`` and ``step_s`` (every timed step); plus the topology's rates,
   the profile and ``speedup`` of the bandwidth-aware plan over the others.

Needs root (namespaces, ``tc``, cgroups); without it the script says so and exits 1.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from absl import app, flags

from launch import script

FLAGS = flags.FLAGS
PLAN_NAMES = {"bandwidth_dp": "bandwidth_aware", "pipedream": "pipedream",
              "oblivious": "oblivious"}
MBIT = 1e6 / 8  # bytes/s in one Mbit/s


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_integer("workers", 4, "Worker processes (pipeline devices).", lower_bound=2)
    flags.DEFINE_enum("topology", "random", ["random", "two_level", "homogeneous"],
                      "Links between the workers: random (uniform in [(1 - spread), 1] x "
                      "fastest), two_level (--devices_per_node per node; links across nodes "
                      "(1 - spread) x fastest) or homogeneous.")
    flags.DEFINE_string("topology_json", None, "Read a planning.Topology JSON instead (its "
                        "proportions; the fastest link becomes --bandwidth_mbit).")
    flags.DEFINE_float("spread", 0.8, "How much slower the slowest link is (fraction).")
    flags.register_validator("spread", lambda v: 0.0 <= v < 1.0, "--spread must be in [0, 1)")
    flags.DEFINE_integer("devices_per_node", 2, "two_level: workers per node.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the random topology, the model and the data.")
    flags.DEFINE_float("bandwidth_mbit", 200.0, "Rate of the fastest link (Mbit/s).")
    flags.register_validator("bandwidth_mbit", lambda v: v > 0, "--bandwidth_mbit must be > 0")
    flags.DEFINE_float("latency_ms", 0.0, "One-way delay on every link (needs netem).")
    flags.DEFINE_float("worker_cpus", None, "CPU quota of every worker and of the client "
                       "(CPUs); default: this machine's cores / --workers, so that the "
                       "workers compute side by side like separate hosts.")
    flags.DEFINE_enum("model", "vgg_fc", ["cnn_small", "vgg_fc"], "Chain model from models/.")
    flags.DEFINE_integer("fc_units", None, "vgg_fc: width of the FC head (default: the "
                         "model's).")
    flags.DEFINE_integer("batch_size", 64, "Mini-batch size.", lower_bound=1)
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per mini-batch.", lower_bound=1)
    flags.DEFINE_integer("steps", 10, "Timed steps per plan.", lower_bound=1)
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps per plan (the first traces).",
                         lower_bound=1)
    flags.DEFINE_integer("profile_repeats", 5, "Timed calls per profiled layer.", lower_bound=1)
    flags.DEFINE_list("plans", list(PLAN_NAMES.values()), "Plans to train.")
    flags.DEFINE_string("out", "runs/pipeline_cluster", "Output directory.")
    flags.DEFINE_string("results_file", None, "Also keep the record in this JSON file under "
                        "runs[<topology>/seed<seed>] (other runs in it are kept), e.g. "
                        "benchmarks/results/pipeline_cluster.json.")
    flags.DEFINE_string("process_logs", None, "Also write every process's output to this "
                        "directory.")
    flags.register_validator("bandwidth_mbit", lambda v: v > 0, "--bandwidth_mbit must be > 0")
    flags.register_validator("spread", lambda v: 0 <= v < 1, "--spread must be in [0, 1)")
    flags.register_validator("plans", lambda v: v and set(v) <= set(PLAN_NAMES.values()),
                             f"--plans must be a subset of {sorted(PLAN_NAMES.values())}")
    flags.register_validator("worker_cpus", lambda v: v is None or v > 0,
                             "--worker_cpus must be > 0")
    flags.register_multi_flags_validator(
        ["batch_size", "micro_batches"], lambda f: f["batch_size"] % f["micro_batches"] == 0,
        "--micro_batches must divide --batch_size")
    flags.register_multi_flags_validator(
        ["topology", "workers", "devices_per_node"],
        lambda f: f["topology"] != "two_level" or f["workers"] % f["devices_per_node"] == 0,
        "--devices_per_node must divide --workers for --topology=two_level")


def pair_rates(f: Any) -> list[list[float]]:
    """Per-pair link rates (Mbit/s) of the flags' topology."""
    from launch.cluster.shaping import topology_rates
    from tf_blocksparse.planning import Topology

    n, fast = f.workers, f.bandwidth_mbit
    if f.topology_json:
        with open(f.topology_json, encoding="utf-8") as fh:
            topo = Topology.from_json(fh.read())
        if topo.num_devices != n:
            raise app.UsageError(f"--topology_json has {topo.num_devices} devices, "
                                 f"--workers={n}")
    elif f.topology == "random":
        topo = Topology.random_heterogeneous(n, 1.0, f.spread, f.seed)
    elif f.topology == "two_level":
        topo = Topology.two_level(n // f.devices_per_node, f.devices_per_node, 1.0,
                                  1.0 - f.spread)
    else:
        topo = Topology.homogeneous(n, 1.0)
    return topology_rates(topo, fast)


def default_cpus(workers: int) -> float:
    """This machine's cores shared evenly by the workers."""
    return round((os.cpu_count() or 1) / workers, 3)


def time_steps(step: Any, x: Any, y: Any, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step(x, y)`` after ``warmup`` untimed ones
    (each call waits for its loss)."""
    from launch import runtime

    for _ in range(warmup):
        float(step(x, y))
    return [runtime.time_call(lambda: step(x, y)) for _ in range(steps)]


def run_client(f: Any) -> dict:
    """Client side: connect, profile, plan, train every plan, return the record."""
    import keras
    import numpy as np
    import tensorflow as tf

    from launch.cluster.shaping import rates_topology
    from launch.plan_pipeline import DATASET_SHAPES, plan_all
    from models.registry import build_model
    from tf_blocksparse import PipelineTrainer, profile_model
    from tf_blocksparse.planning import simulate_pipeline
    from tf_blocksparse.runtime import remote

    devices = remote.connect(remote.cluster_from_env())
    rates = pair_rates(f)
    topology = rates_topology(rates)
    shape = DATASET_SHAPES["fashion_mnist"]
    kwargs = {"fc_units": f.fc_units} if f.fc_units and f.model == "vgg_fc" else {}
    model = build_model(f.model, shape, 10, seed=f.seed, **kwargs)
    micro = f.batch_size // f.micro_batches
    profile = profile_model(model, shape, micro, repeats=f.profile_repeats, seed=f.seed)
    plans = {PLAN_NAMES[m]: p for m, p in plan_all(profile, topology).items()}
    rng = np.random.default_rng(f.seed)
    x = tf.constant(rng.standard_normal((f.batch_size, *shape)), tf.float32)
    y = tf.constant(rng.integers(0, 10, f.batch_size), tf.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict[str, Any] = {}
    for name in f.plans:
        plan = plans[name]
        trainer = PipelineTrainer(model, plan.stages, loss, keras.optimizers.SGD(0.01),
                                  f.micro_batches, devices)
        times = time_steps(trainer.train_step, x, y, f.warmup_steps, f.steps)
        measured = statistics.median(times)
        predicted = simulate_pipeline(profile, topology, plan, f.micro_batches,
                                      micro_batch_size=micro)["makespan_s"]
        out[name] = {
            "measured_step_s": measured, "predicted_step_s": predicted,
            "measured_over_predicted": measured / predicted,
            "throughput_samples_s": f.batch_size / measured,
            "bottleneck_s": plan.bottleneck_s,
            "stages": [{"layers": [s.first_layer, s.last_layer],
                        "layer_names": [profile.layers[s.first_layer].name,
                                        profile.layers[s.last_layer].name],
                        "worker_tasks": list(s.devices)} for s in plan.stages],
            "step_s": [round(t, 5) for t in times]}
        print(json.dumps({"plan": name, "measured_step_s": round(measured, 4),
                          "predicted_step_s": round(predicted, 4),
                          "stages": [(s.first_layer, s.last_layer, list(s.devices))
                                     for s in plan.stages]}), flush=True)
    record = {"plans": out, "model": f.model, "batch_size": f.batch_size,
              "micro_batches": f.micro_batches, "workers": f.workers,
              "topology": f.topology_json or f.topology, "spread": f.spread,
              "seed": f.seed, "bandwidth_mbit": f.bandwidth_mbit, "latency_ms": f.latency_ms,
              "worker_cpus": f.worker_cpus or default_cpus(f.workers),
              "pair_mbit": [[round(v, 2) for v in row] for row in rates],
              "profile": json.loads(profile.to_json()), "steps": f.steps,
              "warmup_steps": f.warmup_steps, "devices": devices}
    if "bandwidth_aware" in out:
        best = out["bandwidth_aware"]["throughput_samples_s"]
        record["speedup"] = {f"bandwidth_aware_over_{k}": best / v["throughput_samples_s"]
                             for k, v in out.items() if k != "bandwidth_aware"}
    return record


def keep_run(path: str, key: str, record: dict) -> None:
    """Stores ``record`` as ``runs[key]`` of the JSON file at ``path`` (created if absent;
    the profile is left out: it is in the run's own file)."""
    doc = {"runs": {}}
    if os.path.exists(path):
        with open(path) as fh:
            doc = json.load(fh)
    doc.setdefault("runs", {})[key] = {k: v for k, v in record.items() if k != "profile"}
    doc["runs"] = dict(sorted(doc["runs"].items()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from tf_blocksparse.runtime import remote

    f = FLAGS
    if remote.cluster_from_env() is not None:  # the client, inside the cluster
        record = run_client(f)
        os.makedirs(f.out, exist_ok=True)
        path = os.path.join(f.out, "pipeline_cluster.json")
        with open(path, "w") as fh:
            json.dump(record, fh, indent=1)
        if f.results_file:
            keep_run(f.results_file, f"{record['topology']}/seed{f.seed}", record)
        print(json.dumps({"wrote": path, "speedup": record.get("speedup")}), flush=True)
        return 0
    if os.geteuid() != 0:
        print("train_pipeline: the emulated cluster needs root (network namespaces, tc, "
              "cgroups); run it as root", file=sys.stderr)
        return 1
    from launch.cluster.tf_cluster import ServerCluster, WorkerFailure

    cpus = f.worker_cpus or default_cpus(f.workers)
    try:
        with ServerCluster(f.workers, pair_mbit=pair_rates(f), latency_ms=f.latency_ms,
                           worker_cpus=cpus, client_cpus=cpus, log_dir=f.process_logs) as cluster:
            return cluster.run_client([sys.executable, "-m", "launch.train_pipeline",
                                       *sys.argv[1:]])
    except WorkerFailure as e:
        print(f"train_pipeline: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    script.run(main, define_flags)
