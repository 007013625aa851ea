"""Convergence at an equal epoch budget: dense vs block k=1 vs block 1% vs element top-k 1%.

Each run is a real ``--num_workers``-process ``MultiWorkerMirroredStrategy`` cluster of
``launch/train.py`` on loopback (the network does not matter here: only accuracy is compared)
on Fashion-MNIST (digits when absent, said so).  ``--model`` (a small CNN by default) runs with
``--seeds`` seeds per method (mean and sample std of the final test accuracy);
``--extra_model`` (ResNet-20) runs once, seed 0.  Writes ``OUT/convergence.json`` and
``OUT/convergence.png`` (test accuracy per epoch, mean over seeds with a +-std band).

    python launch/bench_convergence.py [--epochs=3] [--train_samples=0] [--seeds=0,1,2]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import experiments  # noqa: E402

FLAGS = flags.FLAGS
#: name -> (launch/experiments method, density, extra launch/train.py flags)
CONV_METHODS = {"dense": ("dense", None, ()), "block_k1": ("block_k1", None, ()),
                "block_1pct": ("block_allgather", 0.01, ()), "topk_1pct": ("topk", 0.01, ()),
                "block_k1_waited": ("block_k1", None, ("--momentum_masking=waited",)),
                "block_k1_small_dense": ("block_k1", None, ("--dense_below=1024",))}
TARGET_POINTS = 0.003


def define_flags() -> None:
    """The script's flags."""
    flags.DEFINE_string("model", "cnn_small", "Model run with every seed.")
    flags.DEFINE_string("extra_model", "resnet20", "Model run once with seed 0 ('' to skip).")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds for --model.")
    flags.DEFINE_list("methods", ["dense", "block_k1", "block_1pct", "topk_1pct"],
                      f"Methods, of {sorted(CONV_METHODS)}.")
    flags.DEFINE_integer("num_workers", 4, "Worker processes.")
    flags.DEFINE_integer("epochs", 3, "Epochs (the same budget for every method).")
    flags.DEFINE_integer("steps_per_epoch", 0, "Cap on steps per epoch (0: a full pass).")
    flags.DEFINE_integer("extra_steps_per_epoch", 0, "Steps-per-epoch cap for --extra_model.")
    flags.DEFINE_integer("batch_size", 128, "Global batch size.")
    flags.DEFINE_integer("train_samples", 0, "Training subset (0: all 60,000).")
    flags.DEFINE_integer("test_samples", 0, "Test subset (0: all 10,000).")
    flags.DEFINE_float("lr", 0.05, "Learning rate (SGD, momentum 0.9).")
    flags.DEFINE_boolean("momentum_correction", True, "Sparse methods keep the momentum per "
                         "worker before the exchange (DGC); dense uses global momentum.")
    flags.DEFINE_string("dataset", "fashion_mnist", "Dataset (launch/train.py --dataset).")
    flags.DEFINE_string("out", "benchmarks/results", "Output directory.")
    flags.DEFINE_boolean("resume", False, "Keep the rows (model x method) of "
                         "OUT/convergence.json with the same budget that this run does not "
                         "compute (e.g. add a method).")


def same_as_k1(model: str, density: float, input_shape: tuple[int, ...] = (28, 28, 1),
               num_classes: int = 10) -> bool:
    """Whether ``density`` keeps exactly one block of every variable of ``model`` (then the
    block-density run is the block k=1 run, step for step)."""
    import tf_blocksparse as tfbs
    from models import registry

    m = registry.build_model(model, input_shape, num_classes, seed=0)
    return all(tfbs.selection.num_selected(lay.num_blocks, density=density) == 1
               for lay in tfbs.blocks.layouts_for(m.trainable_variables, m))


def summarise(model: str, method: str, records: list[dict]) -> dict:
    """Mean / std of the final accuracy and the per-epoch curve of one model x method."""
    finals = [r["test_accuracy"] for r in records]
    curves = [r["history"].get("val_accuracy", []) for r in records]
    epochs = min(len(c) for c in curves)
    return {
        "model": model, "method": method, "seeds": [r["flags"]["seed"] for r in records],
        "final_accuracy": [round(a, 4) for a in finals],
        "mean": round(statistics.fmean(finals), 4),
        "std": round(statistics.stdev(finals), 4) if len(finals) > 1 else 0.0,
        "curve_mean": [round(statistics.fmean(c[e] for c in curves), 4) for e in range(epochs)],
        "curve_std": [round(statistics.stdev([c[e] for c in curves]), 4) if len(curves) > 1
                      else 0.0 for e in range(epochs)],
        "bytes_per_step": records[0]["payload_bytes_per_step"],
        "dense_bytes_per_step": records[0]["dense_bytes_per_step"],
        "wall_s": [r["launcher_wall_s"] for r in records],
    }


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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = FLAGS
    common = [f"--dataset={f.dataset}", f"--epochs={f.epochs}", f"--batch_size={f.batch_size}",
              f"--train_samples={f.train_samples}", f"--test_samples={f.test_samples}",
              f"--lr={f.lr}", f"--momentum_correction={f.momentum_correction}"]
    plans = [(f.model, [int(s) for s in f.seeds], f.steps_per_epoch)]
    if f.extra_model:
        plans.append((f.extra_model, [0], f.extra_steps_per_epoch or f.steps_per_epoch))
    for name in f.methods:
        if name not in CONV_METHODS:
            raise app.UsageError(f"--methods: unknown {name!r}")
    budget = {"num_workers": f.num_workers, "epochs": f.epochs,
              "steps_per_epoch": f.steps_per_epoch or "full pass",
              "extra_steps_per_epoch": f.extra_steps_per_epoch or f.steps_per_epoch or
              "full pass", "global_batch": f.batch_size,
              "train_samples": f.train_samples or "all", "test_samples": f.test_samples or "all",
              "lr": f.lr, "momentum": 0.9, "momentum_correction": f.momentum_correction}
    path = os.path.join(f.out, "convergence.json")
    old_rows = []
    if f.resume and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        if old.get("budget") == budget:
            computed = {(m, name) for m, _, _ in plans for name in f.methods}
            old_rows = [r for r in old["records"] if (r["model"], r["method"]) not in computed]
        else:
            print(f"{path}: another budget, nothing kept", flush=True)
    rows = list(old_rows)
    for model, seeds, steps in plans:
        done: dict[str, dict] = {}
        for name in f.methods:
            method, density, extra = CONV_METHODS[name]
            if (name == "block_1pct" and "block_k1" in done
                    and same_as_k1(model, density)):  # the identical run, not repeated
                rows.append({**done["block_k1"], "method": name,
                             "same_run_as": "block_k1 (1% keeps one block of every variable)"})
                print(json.dumps({"model": model, "method": name, "same_run_as": "block_k1"}),
                      flush=True)
                continue
            recs = []
            for seed in seeds:
                rec = experiments.run_training(
                    method, [f"--model={model}", f"--seed={seed}",
                             f"--steps_per_epoch={steps}", *common, *extra],
                    f.num_workers, density or 0.01)
                recs.append(rec)
                print(json.dumps({"model": model, "method": name, "seed": seed,
                                  "test_accuracy": round(rec["test_accuracy"], 4)}), flush=True)
            done[name] = summarise(model, name, recs)
            rows.append(done[name])
    dense = {r["model"]: r["mean"] for r in rows if r["method"] == "dense"}
    for r in rows:
        if r["model"] in dense:
            r["gap_to_dense_points"] = round(100 * (dense[r["model"]] - r["mean"]), 2)
            r["within_0_3_points"] = dense[r["model"]] - r["mean"] <= TARGET_POINTS
    order = list(CONV_METHODS)
    rows.sort(key=lambda r: (r["model"] != f.model, r["model"], order.index(r["method"])))
    doc = {"budget": budget, "records": rows,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    os.makedirs(f.out, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    _plot(rows, os.path.join(f.out, "convergence.png"),
          f"{f.num_workers} workers, {f.epochs} epochs, mean +- std over seeds")
    print(json.dumps(doc))


if __name__ == "__main__":
    define_flags()
    app.run(main)
