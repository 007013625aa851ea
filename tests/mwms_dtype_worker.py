"""One worker of the 2-process test of narrow dtypes under ``tfbs.MultiWorkerMirroredStrategy``.

Fits a tiny model on uint8 labels (Fashion-MNIST's, read from its IDX files when installed,
else a small uint8 array), saves it from the chief only (``model.save``, as Horovod users
do: no collective may be left waiting), then reduces and gathers values of dtypes the
collectives do not take; writes what came back to ``OUT_DIR/dtypes_<task>.json``.

Usage: python tests/mwms_dtype_worker.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402
from launch import data  # noqa: E402
from tf_blocksparse import _compat  # noqa: E402

EXAMPLES = 64
#: The narrow dtypes, and int32 and float32 as what they must agree with.
DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "uint64", "bool", "bfloat16", "float16",
          "int32", "float32")


def _examples() -> tuple[np.ndarray, np.ndarray]:
    """The first Fashion-MNIST examples as float images and uint8 labels."""
    root = data.DEFAULT_FASHION_MNIST_DIR
    if data.fashion_mnist_available(root):
        x = data.read_idx(os.path.join(root, data.FASHION_MNIST_FILES["x_train"]))
        y = data.read_idx(os.path.join(root, data.FASHION_MNIST_FILES["y_train"]))
        x, y = x[:EXAMPLES], y[:EXAMPLES]
    else:
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, (EXAMPLES, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, EXAMPLES).astype(np.uint8)
    assert y.dtype == np.uint8, y.dtype
    return (x[..., None] / np.float32(255)).astype("float32"), y


def _values(strategy: tf.distribute.Strategy, task: int) -> dict:
    """Reduces (SUM, MEAN, MEAN over axis 0) and gathers a small tensor of every dtype in
    :data:`DTYPES`; this worker's tensor is ``[task, 2 * task + 3]``."""
    out = {}
    for name in DTYPES:
        local = tf.cast(tf.constant([task, 2 * task + 3]), name)
        value = strategy.experimental_distribute_values_from_function(
            lambda _, local=local: local)
        results = {"sum": strategy.reduce("SUM", value, axis=None),
                   "mean": strategy.reduce("MEAN", value, axis=None),
                   "mean0": strategy.reduce("MEAN", value, axis=0),
                   "gather": strategy.gather(value, axis=0)}
        out[name] = {key: [t.dtype.name, tf.cast(t, "float64").numpy().tolist()]
                     for key, t in results.items()}
    return out


#: The coordination heartbeat timeout the strategy of this test is made with.
HEARTBEAT_TIMEOUT_S = 123.0


def main(out_dir: str) -> None:
    run(tfbs.MultiWorkerMirroredStrategy(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S), out_dir)


def run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    """The test's work under ``strategy`` (made with :data:`HEARTBEAT_TIMEOUT_S`)."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x, y = _examples()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3, strides=2),
                                  keras.layers.Flatten(), keras.layers.Dense(10)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), k=1, dense_below=0,
                                        exchange="allgather")
        model.compile(optimizer=opt, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(ds, epochs=1, verbose=0)
    if task == 0:
        model.save(os.path.join(out_dir, "chief.keras"))
    record = {"loss": hist.history["loss"], "values": _values(strategy, task),
              "weights_sum": float(sum(np.abs(w).sum() for w in model.get_weights())),
              "heartbeat_timeout_s": _compat.coordination_heartbeat_timeout_s(),
              "residual_sums": [float(np.sum(c.numpy())) for r in opt.residuals
                                for c in _compat.local_components(r)]}
    with open(os.path.join(out_dir, f"dtypes_{task}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
