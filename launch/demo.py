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

Each method is a real 2-process cluster (``launch/local_cluster.py`` running
``launch/train.py --strategy=multiworker``) on real data: Fashion-MNIST from Debian's
``dataset-fashion-mnist`` (the 8x8 digits of ``datasets/`` when absent, said so), first on loopback,
then (as root: network namespaces and ``tc``) with every worker's link shaped to each rate of
``--links`` (``--shaped_methods`` there: dense and the one-line default, which compresses
where that pays).  Prints a table (link, test accuracy, bytes each worker hands to the
collectives per step, compression ratio, seconds from launch to the end), writes
``OUT/results.json`` and ``OUT/accuracy_vs_bytes.png`` (test accuracy against wall-clock
seconds since launch and against cumulative bytes).  Accuracies count every
image of the test set exactly once; TF op determinism is on, so a re-run reproduces them.

    python -m launch.demo [--epochs=3] [--train_samples=20000] [--out=runs/demo]
"""

from __future__ import annotations

import json
import os

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
    flags.DEFINE_list("methods", list(METHODS), "Which of the methods to run on loopback.")
    flags.DEFINE_list("links", ["30"], "Link rates in Mbit/s to run --shaped_methods on as "
                      "well (needs root; empty: loopback only).")
    flags.DEFINE_list("shaped_methods", ["dense", "block default"],
                      "Which of the methods to run on each shaped link.  There each trains "
                      "until its test accuracy reaches loopback dense's final accuracy minus "
                      "0.3 points (up to --target_epoch_factor times --epochs).")
    flags.DEFINE_integer("target_epoch_factor", 4, "Shaped runs train at most this many "
                         "times --epochs to reach the target.", lower_bound=1)
    flags.register_validator(
        "shaped_methods", lambda m: not m or experiments.known_methods(m, list(METHODS)),
        f"--shaped_methods must be a list of {list(METHODS)}")
    flags.register_validator("methods", lambda m: experiments.known_methods(m, list(METHODS)),
                             f"--methods must be a non-empty list of {list(METHODS)}")
    flags.register_validator("model", lambda m: m in TRAIN_MODELS,
                             f"--model must be one of {TRAIN_MODELS}")


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall, sent) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        label = f"{r['method']} ({r['link']})"
        wall.plot([0.0] + r["epoch_wall_s"], [0.1] + r["val_accuracy"], marker="o",
                  label=label)
        xs = [0.0] + [r["payload_bytes_per_step"] * r["steps_per_epoch"] * (e + 1) / 2**20
                      for e in range(len(r["val_accuracy"]))]
        sent.plot(xs, [0.1] + r["val_accuracy"], marker="o", label=label)
    wall.set_xlabel("wall-clock seconds since launch")
    sent.set_xscale("symlog", linthresh=1.0)
    sent.set_xlabel("cumulative MiB sent per worker")
    for ax in (wall, sent):
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    wall.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['dataset']}, {rows[0]['num_workers']} workers (MWMS)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _run(name: str, link: str, dataset: str, target: float | None = None) -> dict:
    """One method on one link (``loopback`` or a rate in Mbit/s): its table row.  With
    ``target``, up to ``--target_epoch_factor`` times the epochs, stopping once the test
    accuracy reaches ``target``."""
    import time

    tag = name.replace(" ", "_").replace("%", "pct").replace("=", "")
    run_dir = os.path.join(FLAGS.out, tag if link == "loopback" else f"{tag}_{link}mbit")
    config = experiments.train_config(
        METHODS[name], 0.01, strategy="multiworker", dataset=dataset, model=FLAGS.model,
        epochs=FLAGS.epochs, train_samples=FLAGS.train_samples,
        test_samples=FLAGS.test_samples, model_dir=run_dir, batch_size=64, lr=0.05,
        momentum=0.9, deterministic=True)
    if target is not None:
        config = config.replace(epochs=FLAGS.epochs * FLAGS.target_epoch_factor,
                                stop_at_accuracy=round(target, 4))
    cmd = [*experiments.TRAIN, *config.to_flags()]
    shaped = {} if link == "loopback" else {"bandwidth_mbit": float(link)}
    print(f"=== {name} on {link}{'' if link == 'loopback' else ' Mbit/s'}: "
          f"{' '.join(cmd[1:])}", flush=True)
    rc = run_local_cluster(cmd, FLAGS.num_workers, cwd=ROOT, **shaped,
                           env={"TF_CPP_MIN_LOG_LEVEL": "2",
                                "TFBS_LAUNCH_TIME": repr(time.time())})
    if rc != 0:
        raise SystemExit(f"{name}: the cluster failed with exit code {rc}")
    with open(os.path.join(run_dir, "metrics.json")) as f:
        m = json.load(f)
    return {"method": name, "link": link, "dataset": m["dataset"],
            "num_workers": m["num_workers"], "test_accuracy": m["test_accuracy"],
            "test_correct": m["test_correct"], "test_examples": m["test_examples"],
            "wall_s": m["epoch_wall_s"][-1], "train_s": m["train_s_per_epoch"][-1],
            "epochs": len(m["epoch_wall_s"]), "target": target,
            "payload_bytes_per_step": m["payload_bytes_per_step"],
            "dense_bytes_per_step": m["dense_bytes_per_step"],
            "compression_ratio": round(m["compression_ratio"], 1),
            "auto_modes": m.get("auto_modes"), "steps_per_epoch": m["steps_per_epoch"],
            "val_accuracy": m["history"].get("val_accuracy", []),
            "epoch_wall_s": m["epoch_wall_s"], "flags": m["flags"],
            "provenance": m.get("provenance")}


def main(argv: list[str]) -> None:
    del argv
    dataset = "fashion_mnist" if data.fashion_mnist_available() else "digits"
    if dataset == "digits":
        print("NOTE: /usr/share/datasets/fashion-mnist not found (apt-get install "
              "dataset-fashion-mnist); using the 8x8 digits instead")
    os.makedirs(FLAGS.out, exist_ok=True)
    links = list(FLAGS.links)
    if links and os.geteuid() != 0:
        print(f"NOTE: shaped links ({', '.join(links)} Mbit/s) need root (network namespaces "
              f"and tc); running on loopback only")
        links = []
    rows = [_run(name, "loopback", dataset) for name in FLAGS.methods]
    dense = next((r for r in rows if r["method"] == "dense"), None)
    target = None if dense is None else dense["test_accuracy"] - 0.003
    rows += [_run(name, link, dataset, target) for link in links
             for name in FLAGS.shaped_methods]
    header = (f"{'method':14} {'link':>9} {'epochs':>6} {'test_acc':>8} {'correct':>13} "
              f"{'bytes/step':>11} {'dense bytes':>11} {'ratio':>7} {'wall_s':>7}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        correct = f"{r['test_correct']}/{r['test_examples']}"
        link = r["link"] if r["link"] == "loopback" else f"{r['link']} Mb/s"
        print(f"{r['method']:14} {link:>9} {r['epochs']:6d} {r['test_accuracy']:8.4f} "
              f"{correct:>13} "
              f"{r['payload_bytes_per_step']:11d} "
              f"{r['dense_bytes_per_step']:11d} {r['compression_ratio']:6.1f}x "
              f"{r['wall_s']:7.1f}")
    if target is not None and links:
        print(f"\nshaped links: every method trained until its test accuracy reached "
              f"{target:.4f} (loopback dense's final accuracy - 0.3 points); wall_s is the "
              f"seconds from launch to that epoch's end, evaluation and backup included")
    with open(os.path.join(FLAGS.out, "results.json"), "w") as f:
        json.dump({"epochs": FLAGS.epochs, "train_samples": FLAGS.train_samples,
                   "test_samples": FLAGS.test_samples, "deterministic": True,
                   "links": ["loopback", *links], "target": target,
                   "results": rows}, f, indent=1)
    _plot(rows, os.path.join(FLAGS.out, "accuracy_vs_bytes.png"))
    print(f"\nwrote {FLAGS.out}/results.json and {FLAGS.out}/accuracy_vs_bytes.png")


if __name__ == "__main__":
    script.run(main, define_flags)
