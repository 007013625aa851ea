"""One worker of the 2-process ``gradient_accumulation_steps`` test under
``tfbs.MultiWorkerMirroredStrategy`` (collectives inside the window's condition, no merge
call).

Trains a small model by ``strategy.run`` twice: 2 micro-steps per exchange on per-worker
gradients, and one step per window on their mean (the larger batch); then ``model.fit`` with
4 micro-steps per exchange.  Writes the weights, bytes and iterations to
``OUT_DIR/accumulation_<task>.json``.

Usage: python tests/mwms_accumulation_worker.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402

WINDOWS = 3


def _grads(micro: int, task: int, shapes) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * micro + task)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def _mean(window: int, task: int, shapes) -> list[np.ndarray]:
    a, b = _grads(2 * window, task, shapes), _grads(2 * window + 1, task, shapes)
    return [(x + y) / np.float32(2) for x, y in zip(a, b)]


def _train(strategy, task: int, every: int, grads_of) -> dict:
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), k=1,
                                        dense_below=0, exchange="allgather",
                                        gradient_accumulation_steps=every)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    for s in range(WINDOWS * every):
        step(strategy.experimental_distribute_values_from_function(
            lambda _, s=s: tuple(tf.constant(g) for g in grads_of(s, task, shapes))))
    return {"weights": [v.numpy().tolist() for v in variables],
            "iterations": int(opt.iterations.numpy()),
            "payload_bytes": opt.block_sparse_metrics(mean=True)["payload_bytes"]}


def _fit(strategy) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 6)).astype("float32")
    y = rng.integers(0, 3, 128).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), k=1,
                                        dense_below=0, exchange="allgather",
                                        gradient_accumulation_steps=4)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    hist = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
    return {"loss": hist.history["loss"], "iterations": int(opt.iterations.numpy()),
            "weights": [w.tolist() for w in model.get_weights()]}


def main(out_dir: str) -> None:
    run(tfbs.MultiWorkerMirroredStrategy(), out_dir)


def run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    """The test's work under ``strategy``."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    record = {"accumulated": _train(strategy, task, 2, _grads),
              "large_batch": _train(strategy, task, 1, _mean), "fit": _fit(strategy)}
    with open(os.path.join(out_dir, f"accumulation_{task}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
