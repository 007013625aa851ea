"""One worker of the 2-process test of loss scaling: under ``mixed_float16`` worker 1's
gradients overflow at one step, worker 0's do not.

``model.compile`` gets ``tfbs.LossScaleOptimizer(BlockSparseOptimizer(...))`` and keeps it.  A layer
multiplies its input by a factor that a callback sets to inf on worker 1 for batch
``POISONED_BATCH`` only.  After every batch the worker records the optimizer's iterations
and loss scale; at the end its weights, and everything in ``OUT_DIR/mixed_<task>.json``.

Usage: python tests/mwms_mixed_precision_worker.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402

POISONED_BATCH = 2
BATCHES = 5


class Scale(keras.layers.Layer):
    """Multiplies its input by ``factor``, a variable of this worker alone."""

    def __init__(self, factor: tf.Variable, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * tf.cast(self.factor, x.dtype)


class Poison(keras.callbacks.Callback):
    """Sets ``factor`` to inf for batch ``POISONED_BATCH`` on worker ``task`` 1; records the
    iterations and the loss scale after every batch."""

    def __init__(self, factor: tf.Variable, task: int):
        super().__init__()
        self.factor, self.task = factor, task
        self.iterations: list[int] = []
        self.scales: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        poisoned = self.task == 1 and batch == POISONED_BATCH
        self.factor.assign(np.inf if poisoned else 1.0)

    def on_train_batch_end(self, batch, logs=None):
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))


def main(out_dir: str) -> None:
    run(tfbs.MultiWorkerMirroredStrategy(), out_dir)


def run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    """The test's work under ``strategy``, with ``mixed_float16`` as the global policy
    meanwhile (the previous one is restored)."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        _run(strategy, out_dir)
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16 * BATCHES, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    factor = tf.Variable(1.0, trainable=False)  # outside the scope: this worker's own
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(32, activation="relu"), Scale(factor),
            keras.layers.Dense(2, dtype="float32")])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), k=1, dense_below=0,
                                        exchange="allgather")
        model.compile(optimizer=tfbs.LossScaleOptimizer(opt),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.optimizer, tfbs.LossScaleOptimizer)
    poison = Poison(factor, task)
    hist = model.fit(ds, epochs=1, verbose=0, callbacks=[tfbs.BlockSparseMetrics(), poison])
    metrics = opt.block_sparse_metrics()  # a collective: every worker reads it
    np.savez(os.path.join(out_dir, f"mixed_weights_{task}.npz"), *model.get_weights())
    with open(os.path.join(out_dir, f"mixed_{task}.json"), "w") as f:
        json.dump({"iterations": poison.iterations, "scales": poison.scales,
                   "skipped_steps": metrics["skipped_steps"],
                   "payload_bytes": metrics["payload_bytes"],
                   "epoch": {name: hist.history[name] for name in (
                       "skipped_steps", "residual_norm", "payload_bytes")}}, f)


if __name__ == "__main__":
    main(sys.argv[1])
