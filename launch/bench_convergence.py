"""Convergence at an equal epoch budget: dense vs block k=1 always compressed (the library's
compression defaults with ``exchange="allgather"``) vs the literal block k=1 configuration vs
element top-k 1%, several seeds per model.

Each run is a real ``--num_workers``-process ``MultiWorkerMirroredStrategy`` cluster of
``launch/train.py`` on loopback (the network does not matter here: only accuracy is compared)
on Fashion-MNIST (digits when absent, said so), with TF op determinism on.  Every model in
``--models`` runs ``--seeds`` seeds per method for its own number of epochs (the same for every
method); the test accuracy counts every test image exactly once (``test_correct`` /
``test_examples`` per seed).  Runs go seed by seed (every method's seed 0 first) and
``OUT/convergence.json`` is written after every run, so an interrupted bench keeps what
finished and ``--resume`` continues it (also with more seeds or models); with
``--strategy=mirrored`` a run itself trains in ``OUT/partial/MODEL-METHOD-seedN`` and backs up
after every epoch, so a run killed midway (a session's end) resumes from its last epoch when
the same command runs again (:func:`launch.experiments.run_in_one_process`);
``OUT/convergence.png`` shows the test accuracy per epoch, mean over seeds with a +-std band.

    python -m launch.bench_convergence [--models=cnn_small,resnet20] [--seeds=0,1,2]
        [--model_epochs=cnn_small=3,resnet20=5]
"""

from __future__ import annotations

import json
import os
import platform

from absl import app, flags

from launch import experiments, script
from launch import flags as train_flags

FLAGS = flags.FLAGS
CONV_METHODS = experiments.CONVERGENCE_METHODS
TARGET_POINTS = 0.003
#: Fraction of the epochs at the end over which dense must have (nearly) stopped gaining.
CONVERGED_TAIL = 0.25
#: Most test-accuracy gain (fraction, 0.002 = 0.2 points) of dense's mean curve over the last
#: CONVERGED_TAIL of the epochs for a model's budget to count as converged.
CONVERGED_GAIN = 0.002
RULE = (f"converged when dense's mean test accuracy (over seeds) at the last epoch exceeds its "
        f"value {int(CONVERGED_TAIL * 100)}% of the epochs earlier by less than "
        f"{CONVERGED_GAIN * 100:.1f} points; target = dense's converged mean - "
        f"{TARGET_POINTS * 100:.1f} points")


#: Budget entries derived from the runs (per model), not set by the flags.
_DERIVED = ("epochs", "lr_by_model", "density", "rule", "converged")


def same_budget(old: dict, common: dict) -> bool:
    """Whether a results file's budget was set by the same flags as ``common`` (its epochs,
    rule and verdicts, written from the runs, are compared per model elsewhere)."""
    return {k: v for k, v in old.items() if k not in _DERIVED} == common


def converged(curve_mean: list[float], tail: float = CONVERGED_TAIL,
              gain: float = CONVERGED_GAIN) -> dict:
    """Whether a mean accuracy curve (one value per epoch) has converged by :data:`RULE`.

    Returns:
        ``{"converged", "tail_gain_points", "from_epoch"}``: the rule's verdict, the gain (in
        points) from epoch ``from_epoch`` (1-based; the epoch ``tail`` of the run before the
        end) to the last epoch.
    """
    epochs = len(curve_mean)
    if epochs < 2:
        return {"converged": False, "tail_gain_points": None, "from_epoch": None}
    start = max(1, epochs - max(1, round(tail * epochs)))  # 1-based epoch compared with the last
    delta = curve_mean[-1] - curve_mean[start - 1]
    return {"converged": delta < gain, "tail_gain_points": round(100 * delta, 2),
            "from_epoch": start}


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_list("models", ["cnn_small", "resnet20"], "Models, each run with every seed.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (model initialisation and data order).")
    flags.DEFINE_list("methods", ["dense", "block_default", "block_source", "topk_1pct"],
                      f"Methods, of {list(CONV_METHODS)} (launch/experiments.py).")
    flags.DEFINE_integer("num_workers", 4, "Replicas: worker processes, or logical CPUs "
                         "with --strategy=mirrored.", lower_bound=1)
    flags.DEFINE_enum("strategy", "multiworker", ["multiworker", "mirrored"],
                      "multiworker: a --num_workers-process cluster on loopback; mirrored: one "
                      "process, MirroredStrategy on --num_workers logical CPUs (the same "
                      "exchange per replica, faster on a few cores; accuracy only).")
    flags.DEFINE_integer("epochs", 3, "Epochs (the same budget for every method).",
                         lower_bound=1)
    flags.register_validator("methods", lambda m: experiments.known_methods(m, CONV_METHODS),
                             f"--methods must be a non-empty list of {list(CONV_METHODS)}")
    flags.register_validator("seeds", experiments.seed_list,
                             "--seeds must be a list of distinct integers >= 0")
    flags.register_validator("models", lambda m: experiments.known_methods(
        m, train_flags.MODELS), f"--models must be a non-empty list of {train_flags.MODELS}")
    flags.DEFINE_list("model_epochs", ["resnet20=5"], "Per-model MODEL=EPOCHS overriding "
                      "--epochs.")
    flags.DEFINE_list("model_lr", ["vgg_fc=0.01"], "Per-model MODEL=LR overriding --lr "
                      "(vgg_fc's 17M-weight dense layers diverge at 0.05).")
    flags.DEFINE_float("density", 0.01, "Density of the methods that take one "
                       "(block_allgather, topk); recorded in each run's flags.")
    flags.DEFINE_integer("steps_per_epoch", 0, "Cap on steps per epoch (0: a full pass).")
    flags.DEFINE_integer("batch_size", 128, "Global batch size.")
    flags.DEFINE_integer("train_samples", 0, "Training subset (0: all 60,000).")
    flags.DEFINE_integer("test_samples", 0, "Test subset (0: all 10,000).")
    flags.DEFINE_float("lr", 0.05, "Learning rate (SGD, momentum 0.9); the peak one under "
                       "a schedule.")
    flags.DEFINE_enum("lr_schedule", "cosine", ["constant", "cosine"],
                      "launch.train --lr_schedule (cosine: decays to 0 at the last step).")
    flags.DEFINE_float("warmup_epochs", 0.0, "launch.train --warmup_epochs.", lower_bound=0.0)
    flags.DEFINE_string("dataset", "fashion_mnist", "Dataset (launch/train.py --dataset).")
    flags.DEFINE_string("out", "benchmarks/results", "Output directory.")
    flags.DEFINE_boolean("resume", False, "Keep the runs (model x method x seed) of "
                         "OUT/convergence.json with the same budget (and those of models not "
                         "in --models); run only the missing ones.")


def model_epochs(entries: list[str]) -> dict[str, int]:
    """Parses ``--model_epochs`` entries ``MODEL=EPOCHS`` (EPOCHS >= 1)."""
    out = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise app.UsageError(f"--model_epochs entries must be MODEL=EPOCHS with EPOCHS >= "
                                 f"1, got {entry!r}")
        out[name] = int(value)
    return out


def model_lr(entries: list[str]) -> dict[str, float]:
    """Parses ``--model_lr`` entries ``MODEL=LR`` (LR > 0)."""
    out = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        try:
            lr = float(value) if sep and name else 0.0
        except ValueError:
            lr = 0.0
        if lr <= 0:
            raise app.UsageError(f"--model_lr entries must be MODEL=LR with LR > 0, got "
                                 f"{entry!r}")
        out[name] = lr
    return out


def accuracy_curve(record: dict) -> list[float]:
    """The run's per-epoch test accuracy (token accuracy for sequence models)."""
    hist = record["history"]
    return list(hist.get("val_accuracy") or hist.get("val_token_accuracy") or [])


def _counted(record: dict) -> int:
    """The examples the run's test accuracy divides by (``test_counted``; older records of
    a sequence model lack it and give it as correct / accuracy)."""
    if "test_counted" in record:
        return int(record["test_counted"])
    if record["test_accuracy"] and record["test_correct"] != round(
            record["test_accuracy"] * record["test_examples"]):
        return round(record["test_correct"] / record["test_accuracy"])
    return int(record["test_examples"])


def summarise(model: str, method: str, records: list[dict]) -> dict:
    """Mean / std of the final accuracy and the per-epoch curve of one model x method."""
    finals = [r["test_accuracy"] for r in records]
    curves = [accuracy_curve(r) for r in records]
    epochs = min(len(c) for c in curves)
    final = experiments.spread(finals)
    per_epoch = [experiments.spread([c[e] for c in curves]) for e in range(epochs)]
    return {
        "model": model, "method": method, "seeds": [r["flags"]["seed"] for r in records],
        "final_accuracy": [round(a, 4) for a in finals],
        "test_correct": [r["test_correct"] for r in records],
        # what the accuracy counts: test images, or target tokens of a sequence model
        "test_examples": [_counted(r) for r in records],
        "mean": final["mean"], "std": final["std"],
        "curve_mean": [e["mean"] for e in per_epoch], "curve_std": [e["std"] for e in per_epoch],
        "epochs": epochs, "steps": records[0]["steps"],
        "bytes_per_step": records[0]["payload_bytes_per_step"],
        "dense_bytes_per_step": records[0]["dense_bytes_per_step"],
        "wall_s": [r["launcher_wall_s"] for r in records],
    }


def add_gaps(rows: list[dict]) -> None:
    """Gap to dense (points, positive = below dense) and byte ratio of every row."""
    dense = {r["model"]: r["mean"] for r in rows if r["method"] == "dense"}
    for r in rows:
        r["compression_ratio"] = round(r["dense_bytes_per_step"] / r["bytes_per_step"], 1)
        if r["model"] in dense:
            r["gap_to_dense_points"] = round(100 * (dense[r["model"]] - r["mean"]), 2)
            r["within_0_3_points"] = dense[r["model"]] - r["mean"] <= TARGET_POINTS


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model):
            xs = list(range(1, len(r["curve_mean"]) + 1))
            lo = [m - s for m, s in zip(r["curve_mean"], r["curve_std"])]
            hi = [m + s for m, s in zip(r["curve_mean"], r["curve_std"])]
            ax.plot(xs, r["curve_mean"], marker="o", label=f"{r['method']} ({len(r['seeds'])})")
            ax.fill_between(xs, lo, hi, alpha=0.2)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise_runs(runs: list[dict], models: list[str]) -> list[dict]:
    """One summary row per model x method of ``runs`` (seed order), gaps to dense added."""
    order = list(CONV_METHODS)
    keys = sorted({(r["model"], r["method"]) for r in runs},
                  key=lambda k: (models.index(k[0]) if k[0] in models else len(models), k[0],
                                 order.index(k[1]) if k[1] in order else len(order)))
    rows = []
    for model, method in keys:
        recs = sorted((r for r in runs if (r["model"], r["method"]) == (model, method)),
                      key=lambda r: r["flags"]["seed"])
        rows.append(summarise(model, method, recs))
    add_gaps(rows)
    return rows


def _slim(record: dict) -> dict:
    keep = ("model", "method", "test_accuracy", "test_loss", "test_correct", "test_examples",
            "test_counted",
            "steps", "steps_per_epoch", "payload_bytes_per_step", "dense_bytes_per_step",
            "launcher_wall_s", "train_s_per_epoch", "provenance")
    out = {k: record[k] for k in keep if k in record}
    out["flags"] = dict(record["flags"])  # every flag of the run: it can be repeated
    out["history"] = {"val_accuracy": accuracy_curve(record)}
    return out


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = FLAGS
    overrides = model_epochs(f.model_epochs)
    lrs = model_lr(f.model_lr)
    seeds = [int(s) for s in f.seeds]
    common = {"num_workers": f.num_workers, "strategy": f.strategy,
              "steps_per_epoch": f.steps_per_epoch or "full pass",
              "global_batch": f.batch_size, "train_samples": f.train_samples or "all",
              "test_samples": f.test_samples or "all", "lr": f.lr, "momentum": 0.9,
              "lr_schedule": f.lr_schedule, "warmup_epochs": f.warmup_epochs,
              "deterministic": True, "dataset": f.dataset}
    path = os.path.join(f.out, "convergence.json")
    doc = {"budget": {**common, "epochs": {}, "lr_by_model": {}}, "records": [], "runs": [],
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    if f.resume and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        if same_budget(old.get("budget", {}), common):
            epochs_old = old["budget"]["epochs"]
            lr_old = old["budget"].get("lr_by_model", {})
            for model, n in epochs_old.items():  # a model keeps its runs at the same budget
                same_lr = lr_old.get(model, f.lr) == lrs.get(model, f.lr)
                if model not in f.models or (overrides.get(model, f.epochs) == n and same_lr):
                    doc["budget"]["epochs"][model] = n
                    doc["budget"]["lr_by_model"][model] = lr_old.get(model, f.lr)
            doc["runs"] = [r for r in old.get("runs", []) if r["model"] in doc["budget"]["epochs"]]
        else:
            print(f"{path}: another budget, nothing kept", flush=True)
    models_seen = list(dict.fromkeys([*f.models, *doc["budget"]["epochs"]]))

    def write() -> None:
        doc["records"] = summarise_runs(doc["runs"], models_seen)
        doc["budget"]["rule"] = RULE
        doc["budget"]["converged"] = {r["model"]: converged(r["curve_mean"])
                                      for r in doc["records"] if r["method"] == "dense"}
        os.makedirs(f.out, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1)

    for model in f.models:
        epochs = overrides.get(model, f.epochs)
        doc["budget"]["epochs"][model] = epochs
        doc["budget"]["lr_by_model"][model] = lr = lrs.get(model, f.lr)
        budget = dict(dataset=f.dataset, epochs=epochs, batch_size=f.batch_size,
                      train_samples=f.train_samples, test_samples=f.test_samples, lr=lr,
                      momentum=0.9, steps_per_epoch=f.steps_per_epoch,
                      lr_schedule=f.lr_schedule, warmup_epochs=f.warmup_epochs, model=model)
        for seed in seeds:  # seed-major: an interrupted bench has every method's first seeds
            for name in f.methods:
                if any((r["model"], r["method"], r["flags"]["seed"]) == (model, name, seed)
                       for r in doc["runs"]):
                    print(f"{model} {name} seed {seed}: kept from {path}", flush=True)
                    continue
                config = experiments.train_config(name, f.density, seed=seed, **budget)
                if f.strategy == "mirrored":  # resumable by epoch: killed, rerun it
                    rec = experiments.run_in_one_process(
                        name, config, f.num_workers,
                        run_dir=os.path.join(f.out, "partial", f"{model}-{name}-seed{seed}"))
                else:
                    rec = experiments.run_training(name, config, f.num_workers)
                rec["model"], rec["method"] = model, name
                doc["runs"].append(_slim(rec))
                print(json.dumps({"model": model, "method": name, "seed": seed,
                                  "test_accuracy": round(rec["test_accuracy"], 4),
                                  "test_correct": rec["test_correct"]}), flush=True)
                write()  # after every run: an interrupted bench keeps what finished
    write()
    _plot(doc["records"], os.path.join(f.out, "convergence.png"),
          f"{f.num_workers} workers, epochs {doc['budget']['epochs']}, mean +- std over seeds")
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}))


if __name__ == "__main__":
    script.run(main, define_flags)
