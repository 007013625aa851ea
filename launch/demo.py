"""Single-host demo: dense vs block-sparse exchange on real data, 2 replicas.

MirroredStrategy over two logical CPU devices, Fashion-MNIST from Debian's
``dataset-fashion-mnist`` (scikit-learn's digits when it is absent), the same CNN, seed and
batches for every method.  Prints a table of test accuracy, bytes handed to the collectives
per step per replica, compression ratio and wall time, and writes it as JSON.

    python launch/demo.py [--epochs=2] [--train_samples=20000] [--out=runs/demo.json]
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_CPUS = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_CPUS[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from absl import app, flags  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402
from launch import data  # noqa: E402
from models.cnn import cnn_small  # noqa: E402

FLAGS = flags.FLAGS

METHODS = {
    "dense": {"exchange": "dense"},
    "block k=1 (allgather)": {"k": 1, "exchange": "allgather"},
    "block 5% (shared)": {"density": 0.05, "exchange": "shared"},
}


def define_flags() -> None:
    flags.DEFINE_integer("epochs", 2, "Epochs per method.")
    flags.DEFINE_integer("train_samples", 20000, "Training subset size (0 = all).")
    flags.DEFINE_integer("batch_size", 64, "Global batch size.")
    flags.DEFINE_float("lr", 0.05, "SGD learning rate.")
    flags.DEFINE_float("momentum", 0.9, "SGD (global) momentum.")
    flags.DEFINE_string("data_dir", "/usr/share/datasets/fashion-mnist", "IDX files.")
    flags.DEFINE_string("out", "runs/demo.json", "Where to write the results JSON.")


def run_method(strategy, name, kwargs, train, test) -> dict:
    (x, y), (xt, yt) = train, test
    with strategy.scope():
        model = cnn_small(x.shape[1:], 10, seed=0)
        opt = tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(FLAGS.lr, momentum=FLAGS.momentum), **kwargs)
        model.compile(optimizer=opt, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=2,
                     shuffle=True, callbacks=[tfbs.BlockSparseMetrics()])
    wall = time.perf_counter() - t0
    loss, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
    m = opt.block_sparse_metrics()
    return {"method": name, "test_accuracy": round(float(acc), 4),
            "test_loss": round(float(loss), 4), "payload_bytes_per_step": int(m["payload_bytes"]),
            "dense_bytes_per_step": int(m["dense_bytes"]),
            "compression": round(m["dense_bytes"] / m["payload_bytes"], 1),
            "wall_s": round(wall, 1), "final_train_loss": round(hist.history["loss"][-1], 4)}


def main(argv: list[str]) -> None:
    del argv
    if data.fashion_mnist_available(FLAGS.data_dir):
        name, (train, test) = "fashion_mnist", data.load_fashion_mnist(FLAGS.data_dir)
    else:
        print(f"NOTE: {FLAGS.data_dir} not found (apt-get install dataset-fashion-mnist); "
              "using scikit-learn's digits instead")
        name, (train, test) = "digits", data.load_digits()
    if FLAGS.train_samples:
        train = (train[0][:FLAGS.train_samples], train[1][:FLAGS.train_samples])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print(f"dataset={name} train={len(train[0])} test={len(test[0])} "
          f"replicas={strategy.num_replicas_in_sync} epochs={FLAGS.epochs}")
    rows = [run_method(strategy, n, kw, train, test) for n, kw in METHODS.items()]
    header = (f"{'method':24} {'test_acc':>8} {'bytes/step':>11} {'dense':>9} {'ratio':>7} "
              f"{'wall_s':>7}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['method']:24} {r['test_accuracy']:8.4f} {r['payload_bytes_per_step']:11d} "
              f"{r['dense_bytes_per_step']:9d} {r['compression']:6.1f}x {r['wall_s']:7.1f}")
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"dataset": name, "epochs": FLAGS.epochs, "train_samples": len(train[0]),
                   "replicas": strategy.num_replicas_in_sync, "results": rows}, f, indent=1)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
