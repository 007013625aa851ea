"""One worker of the multi-process exact-evaluation tests (reads TF_CONFIG).

Usage: python tests/eval_worker.py OUT_DIR (3 workers); with 2 workers it runs as the
``evaluation`` scenario of ``tests/mwms_worker.py`` (:func:`run`).

Builds a small CNN (seeded, so every worker and the test build the same weights), evaluates
203 examples with batch 64 (sizes that are not multiples of the batch or of the workers) and
a constant model that always predicts class 0 on 360 examples, 130 of them class 0, with
batch 256 (the case ``model.evaluate`` on a replicated data set gets wrong).  Every worker
writes its figures and the CNN's weights to ``OUT_DIR/eval_<task>.json`` / ``.npz``.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402
from tf_blocksparse.keras.evaluation import evaluate_exactly  # noqa: E402

N, BATCH = 203, 64


def cnn_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return (rng.standard_normal((N, 8, 8, 1)).astype("float32"),
            rng.integers(0, 3, N).astype("int32"))


def build_cnn() -> keras.Model:
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def constant_data() -> tuple[np.ndarray, np.ndarray]:
    y = np.array([0] * 130 + [1] * 120 + [2] * 110, dtype="int32")
    y = y[np.random.default_rng(0).permutation(len(y))]
    return np.zeros((len(y), 4), "float32"), y


def build_constant() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant([1.0, 0.5, 0.0]))])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _keras_replicated_evaluate(model: keras.Model) -> dict:
    """``model.evaluate`` on the whole set on every worker (auto-shard OFF), for the record.

    (With 3 workers and batch 256 Keras fails outright: the batch does not split evenly.)
    """
    xs, ys = constant_data()
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(256).with_options(opts)
    return model.evaluate(ds, verbose=0, return_dict=True)


def run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    """Evaluates both models under ``strategy`` and writes this worker's figures."""
    task = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    with strategy.scope():
        cnn, const = build_cnn(), build_constant()
    a = evaluate_exactly(cnn, *cnn_data(), batch_size=BATCH)
    b = evaluate_exactly(const, *constant_data(), batch_size=256)
    keras_eval = None
    if strategy.num_replicas_in_sync == 2:  # what Keras reports on the replicated set
        keras_eval = _keras_replicated_evaluate(const)
    np.savez(os.path.join(out_dir, f"eval_{task}.npz"), *cnn.get_weights())
    with open(os.path.join(out_dir, f"eval_{task}.json"), "w") as f:
        json.dump({"cnn": vars(a), "constant": vars(b), "keras_evaluate": keras_eval,
                   "replicas": strategy.num_replicas_in_sync}, f)


if __name__ == "__main__":
    run(tfbs.MultiWorkerMirroredStrategy(), sys.argv[1])
