"""Time to accuracy on a bandwidth-limited cluster: dense vs block (allgather, shared) vs
element top-k at the same density.

Every run is a real ``--num_workers``-process ``MultiWorkerMirroredStrategy`` cluster of
``launch/train.py`` on Fashion-MNIST (digits when absent, said so), each worker in its own
network namespace with its link shaped by ``tc`` to ``--bandwidths_mbit`` (needs root: without
it the script says so and stops).  Per model x bandwidth x method it records the test
accuracy after every epoch against the training seconds spent so far (validation excluded),
and derives:

- ``time_to_target_s``: training seconds until the test accuracy first reaches the dense run's
  final accuracy minus ``--target_drop`` (0.3 points);
- ``speedup_vs_dense``: dense's time to that target over the method's (``null`` if never);
- ``final_accuracy``, ``bytes_per_step`` (handed to the collectives per worker), ``wall_s``.

Dense trains ``--epochs`` epochs (its final accuracy sets the target); the sparse methods may
train ``--sparse_epoch_factor`` times as many (their steps are cheaper on a slow link), and
their time to target is the training time until they first reach it.

With several ``--seeds`` the runs go seed by seed (every method's seed 0, then seed 1, ...),
so a slow spell of the machine falls on all methods alike; each seed's dense run sets that
seed's target, and ``summary`` gives the mean, std, min and max over the seeds.

Writes ``OUT/time_to_accuracy_early.json`` (``records``: one per model x bandwidth x method x seed;
``summary``: one per model x bandwidth x method; the budget) and ``OUT/time_to_accuracy_early.png``
(accuracy vs training time and vs bytes).

    python -m launch.bench_time_to_accuracy [--models=vgg_fc,resnet20]
        [--bandwidths_mbit=100,1000] [--epochs=6] [--steps_per_epoch=20] [--density=0.01]
        [--seeds=0,1,2]
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable

from absl import app, flags

from launch import experiments, script
from launch import flags as train_flags
from launch.config import TrainConfig
from launch.tta_figures import (
    aggregate,
    group_key,
    group_records,
    kept_groups,
    runs_to_do,
    steady_step_s,
)
from tf_blocksparse.options import MASKINGS

FLAGS = flags.FLAGS
TTA_METHODS = experiments.TIME_TO_ACCURACY_METHODS


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_list("models", ["vgg_fc", "resnet20"], "Models (launch/train.py --model).")
    flags.DEFINE_list("bandwidths_mbit", ["100", "1000"], "Link rates to shape to.")
    flags.DEFINE_float("latency_ms", 0.0, "One-way delay added on every shaped link (needs "
                       "the kernel's netem module).")
    flags.DEFINE_list("methods", list(TTA_METHODS), "Methods (dense first).")
    flags.DEFINE_list("seeds", ["0"], "Seeds (initialisation and data order); every method "
                      "runs every seed, seed by seed.")
    flags.register_validator("seeds", experiments.seed_list,
                             "--seeds must be a list of distinct integers >= 0")
    flags.DEFINE_integer("num_workers", 4, "Worker processes.", lower_bound=1)
    flags.DEFINE_float("density", 0.05, "Fraction kept by block and element top-k.")
    flags.register_validator("density", lambda d: 0.0 < d <= 1.0, "--density must be in (0, 1]")
    flags.register_validator("methods", lambda m: experiments.known_methods(m, TTA_METHODS),
                             f"--methods must be a non-empty list of {list(TTA_METHODS)}")
    flags.register_validator("models", lambda m: experiments.known_methods(
        m, train_flags.MODELS), f"--models must be a non-empty list of {train_flags.MODELS}")
    flags.register_validator("bandwidths_mbit", _positive_numbers,
                             "--bandwidths_mbit must be a list of numbers > 0")
    flags.DEFINE_integer("epochs", 6, "Epochs of the dense run (one test evaluation each).")
    flags.DEFINE_integer("sparse_epoch_factor", 4, "Sparse methods may train this many times "
                         "as many epochs (they stop counting once they reach the target).")
    flags.DEFINE_integer("steps_per_epoch", 20, "Training steps per epoch.")
    flags.DEFINE_integer("batch_size", 128, "Global batch size.")
    flags.DEFINE_integer("train_samples", 0, "Training subset (0: all 60,000).")
    flags.DEFINE_integer("test_samples", 2000, "Test subset evaluated after every epoch.")
    flags.DEFINE_float("lr", 0.05, "Learning rate (SGD, momentum 0.9).")
    flags.DEFINE_list("model_lr", ["vgg_fc=0.01"], "Per-model learning rates MODEL=LR "
                      "overriding --lr (vgg_fc has no normalisation; 0.05 oscillates).")
    flags.DEFINE_enum("momentum_masking", "all", list(MASKINGS), "Sparse methods: "
                      "which sent blocks leave the local momentum (launch/train.py "
                      "--momentum_masking); one value for every sparse method and model.")
    flags.DEFINE_integer("dense_below", None, "Sparse methods send variables with fewer "
                         "elements whole (launch/train.py --dense_below; default: the "
                         "library's).")
    flags.DEFINE_list("model_steps_per_epoch", [], "Per-model MODEL=STEPS overriding "
                      "--steps_per_epoch (e.g. resnet20=50: its BatchNorm statistics need "
                      "more steps before test accuracy means anything).")
    flags.DEFINE_boolean("global_momentum", False, "Sparse methods apply the momentum after "
                         "the exchange (launch/train.py --global_momentum); default: the "
                         "library's, per worker before the exchange.")
    flags.DEFINE_boolean("early_stop", True, "Sparse runs stop once they reach the target "
                         "after at least the dense run's epochs (their final accuracy is then "
                         "taken at >= as many steps as dense's).")
    flags.DEFINE_boolean("resume", False, "Keep the groups (model x bandwidth) already in "
                         "OUT/time_to_accuracy_early.json with the same budget, and those of "
                         "models not in --models (each group keeps its budget in "
                         "group_budgets); run the rest, and the --methods a kept group lacks.")
    flags.DEFINE_list("rerun", [], "With --resume: methods to run again in kept groups "
                      "(e.g. dense, to measure it side by side with a method added now; "
                      "the target does not move: runs are deterministic).")
    flags.DEFINE_float("target_drop", 0.003, "Target = dense final accuracy minus this.")
    flags.DEFINE_string("dataset", "fashion_mnist", "Dataset (launch/train.py --dataset).")
    flags.DEFINE_string("out", "benchmarks/results", "Output directory.")
    flags.DEFINE_float("run_timeout_s", 1800, "Kill a run after this long.")
    flags.register_validator("rerun", lambda m: not m or experiments.known_methods(
        m, TTA_METHODS), f"--rerun must list methods of {list(TTA_METHODS)}")


def _positive_numbers(values: list[str]) -> bool:
    try:
        return bool(values) and all(float(v) > 0 for v in values)
    except ValueError:
        return False


def model_overrides(flag: str, entries: list[str], cast: type) -> dict[str, float]:
    """Parses ``--flag`` entries ``MODEL=VALUE`` (VALUE > 0, of type ``cast``)."""
    out = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        try:
            parsed = cast(value)
        except ValueError:
            parsed = -1
        if not sep or not name or not parsed > 0:
            raise app.UsageError(f"--{flag} entries must be MODEL=VALUE with VALUE > 0, got "
                                 f"{entry!r}")
        out[name] = parsed
    return out


def _train_config(model: str, budget: dict, seed: int, method: str, target: float | None
                  ) -> TrainConfig:
    """The ``launch.train`` config of one run."""
    f = FLAGS
    config = experiments.train_config(
        method, f.density, model=model, dataset=f.dataset,
        steps_per_epoch=budget["steps_per_epoch"], batch_size=f.batch_size,
        train_samples=f.train_samples, test_samples=f.test_samples, lr=budget["lr"],
        momentum=0.9, seed=seed, epochs=f.epochs)
    if method == "dense":
        return config
    options = config.method.options
    if f.dense_below is not None:
        options = options.replace(dense_below=f.dense_below)
    config = config.replace(
        epochs=f.epochs * f.sparse_epoch_factor,
        method=config.method.replace(options=options, momentum_masking=f.momentum_masking,
                                     global_momentum=f.global_momentum))
    if f.early_stop and target is not None:
        config = config.replace(stop_at_accuracy=target, min_epochs=f.epochs)
    return config


def run_group(model: str, bw: float, budget: dict, methods: list[str], seeds: list[int],
              kept: list[dict], rerun: list[str], on_run: Callable[[list[dict]], None]
              ) -> list[dict] | None:
    """The runs of one model x bandwidth group: ``kept`` ones plus, seed by seed, every
    method a seed lacks (or in ``rerun``); ``on_run(runs so far)`` after every run; ``None``
    when nothing was run."""
    f = FLAGS
    todo = runs_to_do(kept, methods, seeds, rerun)
    if not todo:
        return None
    # a kept run stays until its re-run replaces it: every seed keeps its dense run (the
    # target), so the group can be summarised after every run
    runs = list(kept)
    order = {m: i for i, m in enumerate(methods)}
    for seed, method in todo:
        target = next((max(r["test_accuracy"] - f.target_drop, 1e-6) for r in runs
                       if r["method"] == "dense" and r["seed"] == seed), None)
        rec = experiments.run_training(
            method, _train_config(model, budget, seed, method, target), f.num_workers,
            bandwidth_mbit=bw, latency_ms=f.latency_ms, timeout_s=f.run_timeout_s)
        rec.update(model=model, bandwidth_mbit=bw, seed=seed)
        runs = [r for r in runs if (r["seed"], r["method"]) != (seed, method)] + [rec]
        print(json.dumps({"model": model, "bandwidth_mbit": bw, "method": method,
                          "seed": seed, "final_accuracy": round(rec["test_accuracy"], 4),
                          "train_s": rec["train_s_per_epoch"][-1],
                          "s_per_step": steady_step_s(rec),
                          "bytes_per_step": rec["payload_bytes_per_step"]}), flush=True)
        runs.sort(key=lambda r: (r["seed"], order.get(r["method"], len(order))))
        on_run(runs)
    return runs


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if os.geteuid() != 0:
        sys.exit("bench_time_to_accuracy: shaping links needs root (network namespaces + tc); "
                 "run it as root (CI is root).")
    f = FLAGS
    lrs = model_overrides("model_lr", f.model_lr, float)
    steps = model_overrides("model_steps_per_epoch", f.model_steps_per_epoch, int)
    methods = ["dense"] + [m for m in f.methods if m != "dense"]
    seeds = [int(s) for s in f.seeds]
    common = {"num_workers": f.num_workers, "epochs_dense": f.epochs,
              "epochs_sparse_max": f.epochs * f.sparse_epoch_factor,
              "early_stop": f.early_stop, "global_batch": f.batch_size,
              "train_samples": f.train_samples or "all", "test_samples": f.test_samples,
              "density": f.density, "latency_ms": f.latency_ms, "target_drop": f.target_drop,
              "momentum": 0.9, "global_momentum": f.global_momentum,
              "momentum_masking": f.momentum_masking, "dataset": f.dataset,
              "deterministic": True,
              # what each run's training clock counts (launch/train.py): runs under another
              # clock are not comparable, so a kept group without it is run again
              "clock": "every epoch from a barrier (all workers arrived) to its last step; "
                       "library metrics read once per epoch",
              "rule": "decided before the run, the same for every method: the same seeds, "
                      "run seed by seed; every method evaluated on the same test images "
                      "after every epoch (each image counted once); per seed, target = that "
                      "seed's dense final accuracy minus target_drop; one momentum masking "
                      "for every sparse method; summary = mean/std/min/max over the seeds"}
    if f.dense_below is not None:
        common["dense_below"] = f.dense_below

    def group_budget(model: str) -> dict:
        return {**common, "lr": lrs.get(model, f.lr),
                "steps_per_epoch": steps.get(model, f.steps_per_epoch)}

    path = os.path.join(f.out, "time_to_accuracy_early.json")
    doc = {"budget": {**common, "per_model": {m: {k: group_budget(m)[k] for k in
                                                  ("lr", "steps_per_epoch")}
                                              for m in f.models}},
           "records": [], "runs": {}, "group_budgets": {},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    if f.resume and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        running = {group_key(m, b) for m in f.models for b in f.bandwidths_mbit}
        for key in kept_groups(old, running, group_budget):
            model, budget = key.split(" @ ")[0], old["group_budgets"][key]
            runs = old["runs"][key]
            for r in runs:
                r.setdefault("seed", 0)  # files from before --seeds
            doc["runs"][key], doc["group_budgets"][key] = runs, budget
            # the figures are derived again from the kept runs (the current summarise)
            doc["records"] += group_records(runs, budget)
            if model not in f.models and model in old["budget"].get("per_model", {}):
                doc["budget"]["per_model"][model] = old["budget"]["per_model"][model]
    os.makedirs(f.out, exist_ok=True)

    def store(key: str, budget: dict, runs: list[dict]) -> None:
        """Puts one group's runs and figures into ``doc`` and writes it (an interrupted bench
        keeps every finished run)."""
        records = group_records(runs, budget)
        doc["records"] = [r for r in doc["records"]
                          if group_key(r["model"], r["bandwidth_mbit"]) != key] + records
        doc["runs"][key] = [experiments.slim(r) for r in runs]
        doc["group_budgets"][key] = budget
        doc["summary"] = aggregate(doc["records"])
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)

    for model in f.models:
        budget = group_budget(model)
        for bw in [float(b) for b in f.bandwidths_mbit]:
            key = group_key(model, bw)
            ran = run_group(model, bw, budget, methods, seeds, doc["runs"].get(key, []),
                            f.rerun, lambda runs, k=key, b=budget: store(k, b, runs))
            if ran is None:
                print(f"{key}: kept from {path} (same budget)", flush=True)
    doc["summary"] = aggregate(doc["records"])
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    experiments.plot_curves(doc["runs"], os.path.join(f.out, "time_to_accuracy_early.png"),
                            f"{f.num_workers} workers, shaped links, density {f.density}")
    print(json.dumps({k: v for k, v in doc.items() if k not in ("runs", "records")}))


if __name__ == "__main__":
    script.run(main, define_flags)
