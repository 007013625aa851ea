"""The main job: two local workers under MultiWorkerMirroredStrategy: dense, the one-line
block default, the default compression always applied, and the literal block configuration,
side by side.

- ``dense``: ``BlockSparseOptimizer(SGD(0.05, momentum=0.9), exchange="dense")`` (a plain
  all-reduce);
- ``block default``: ``BlockSparseOptimizer(SGD(0.05, momentum=0.9))``: the automatic
  exchange (``exchange="auto"``), which measures the link and compression and sends dense
  where compression does not pay (on loopback it does not);
- ``block k=1``: ``exchange="allgather"``: one block per variable, the momentum moved before
  the exchange (DGC correction), variables under 1,024 elements sent whole;
- ``block literal``: one block of every variable, global momentum after the exchange
  (``momentum_correction=None, dense_below=0``).

Each method is a real 2-process cluster on loopback (``launch/local_cluster.py`` running
``launch/train.py --strategy=multiworker``) on real data: Fashion-MNIST from Debian's
``dataset-fashion-mnist`` (scikit-learn's digits when absent, said so).  Prints a table (test
accuracy, bytes each worker hands to the collectives per step, compression ratio, wall
time), writes ``OUT/results.json`` and ``OUT/accuracy_vs_bytes.png``.  Accuracies count every
image of the test set exactly once; TF op determinism is on, so a re-run reproduces them.

    python -m launch.demo [--epochs=3] [--train_samples=20000] [--out=runs/demo]
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from launch import data, experiments, script
from launch import flags as train_flags
from launch.cluster.local import run_local_cluster

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METHODS = experiments.DEMO_METHODS
TRAIN_MODELS = train_flags.MODELS


def define_flags() -> None:
    flags.DEFINE_integer("epochs", 3, "Epochs per method.", lower_bound=1)
    flags.DEFINE_integer("train_samples", 20000, "Training subset (0 = all 60000).")
    flags.DEFINE_integer("test_samples", 0, "Test subset (0 = the whole test set).")
    flags.DEFINE_integer("num_workers", 2, "Worker processes.", lower_bound=1)
    flags.DEFINE_string("model", "cnn_small", "Model (see launch/train.py --model).")
    flags.DEFINE_string("out", "runs/demo", "Output directory.")
    flags.DEFINE_list("methods", list(METHODS), "Which of the methods to run.")
    flags.register_validator("methods", lambda m: experiments.known_methods(m, list(METHODS)),
                             f"--methods must be a non-empty list of {list(METHODS)}")
    flags.register_validator("model", lambda m: m in TRAIN_MODELS,
                             f"--model must be one of {TRAIN_MODELS}")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        xs = [0.0] + [r["payload_bytes_per_step"] * r["steps_per_epoch"] * (e + 1) / 2**20
                      for e in range(len(r["val_accuracy"]))]
        ax.plot(xs, [0.1] + r["val_accuracy"], marker="o", label=r["method"])
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("cumulative MiB sent per worker")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{rows[0]['dataset']}, {rows[0]['num_workers']} workers (MWMS)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    del argv
    dataset = "fashion_mnist" if data.fashion_mnist_available() else "digits"
    if dataset == "digits":
        print("NOTE: /usr/share/datasets/fashion-mnist not found (apt-get install "
              "dataset-fashion-mnist); using scikit-learn's digits instead")
    os.makedirs(FLAGS.out, exist_ok=True)
    rows = []
    for name in FLAGS.methods:
        run_dir = os.path.join(FLAGS.out, name.replace(" ", "_").replace("%", "pct")
                               .replace("=", ""))
        cmd = [sys.executable, "-m", "launch.train",
               "--strategy=multiworker", f"--dataset={dataset}", f"--model={FLAGS.model}",
               f"--epochs={FLAGS.epochs}", f"--train_samples={FLAGS.train_samples}",
               f"--test_samples={FLAGS.test_samples}", f"--model_dir={run_dir}",
               "--batch_size=64", "--lr=0.05", "--momentum=0.9", "--deterministic",
               *experiments.method_flags(METHODS[name], 0.01)]
        print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
        rc = run_local_cluster(cmd, FLAGS.num_workers, cwd=ROOT,
                               env={"TF_CPP_MIN_LOG_LEVEL": "2"})
        if rc != 0:
            raise SystemExit(f"{name}: the cluster failed with exit code {rc}")
        with open(os.path.join(run_dir, "metrics.json")) as f:
            m = json.load(f)
        rows.append({"method": name, "dataset": m["dataset"], "num_workers": m["num_workers"],
                     "test_accuracy": m["test_accuracy"], "test_correct": m["test_correct"],
                     "test_examples": m["test_examples"], "wall_s": m["wall_s"],
                     "payload_bytes_per_step": m["payload_bytes_per_step"],
                     "dense_bytes_per_step": m["dense_bytes_per_step"],
                     "compression_ratio": round(m["compression_ratio"], 1),
                     "steps_per_epoch": m["steps_per_epoch"],
                     "val_accuracy": m["history"].get("val_accuracy", [])})
    header = (f"{'method':14} {'test_acc':>8} {'correct':>13} {'bytes/step':>11} "
              f"{'dense bytes':>11} {'ratio':>7} {'wall_s':>7}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        correct = f"{r['test_correct']}/{r['test_examples']}"
        print(f"{r['method']:14} {r['test_accuracy']:8.4f} {correct:>13} "
              f"{r['payload_bytes_per_step']:11d} "
              f"{r['dense_bytes_per_step']:11d} {r['compression_ratio']:6.1f}x "
              f"{r['wall_s']:7.1f}")
    with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
        json.dump({"epochs": FLAGS.epochs, "train_samples": FLAGS.train_samples,
                   "test_samples": FLAGS.test_samples, "deterministic": True,
                   "results": rows}, f, indent=1)
    _plot(rows, os.path.join(FLAGS.out, "accuracy_vs_bytes.png"))
    print(f"\nwrote {FLAGS.out}/results.json and {FLAGS.out}/accuracy_vs_bytes.png")


if __name__ == "__main__":
    script.run(main, define_flags)
