"""Client process of the emulated-cluster tests (run by
``launch.cluster.tf_cluster.ServerCluster``).

    python tests/cluster_client.py MODE OUT_JSON

Modes:
  gradients  PipelineTrainer across the worker processes (stage 0 on task 0, stage 1 on tasks
             1..N-1): its gradients and one training step against plain full-batch training
             of the same model in this process.
  hybrid     HybridTrainer: conv replicas on tasks 0..N-2, the FC replica and its state on
             task N-1; gradients against full-batch training in this process.
  loop       Runs a small cross-task function until killed (writes OUT_JSON once running).
  alloc      Creates a 1 GiB variable on task 0.
"""

from __future__ import annotations

import json
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_blocksparse as tfbs
from tf_blocksparse.runtime import remote


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(12, activation="relu", name="fc1"),
        keras.layers.Dense(5, name="logits")])


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.standard_normal((batch, 6, 6, 2)).astype("float32"),
            rng.integers(0, 5, batch).astype("int32"))


def _reference(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    return [g.numpy() for g in tape.gradient(value, model.trainable_variables)]


def main(mode: str, out: str) -> None:
    devices = remote.connect(remote.cluster_from_env())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    record: dict = {"devices": devices}
    if mode in ("gradients", "hybrid"):
        x, y = _data(12)
        model = _model(0)
        want = _reference(model, x, y)
        if mode == "gradients":
            trainer = tfbs.PipelineTrainer(model, [(0, 1, [0]), (2, 3, list(range(1, len(
                devices))))], loss, keras.optimizers.SGD(0.1), micro_batches=2,
                devices=devices)
            record["variable_devices"] = sorted({v.value.device for reps in trainer.replicas
                                                 for r in reps for v in r.trainable})
        else:
            trainer = tfbs.HybridTrainer(model, devices[:-1], devices[-1:],
                                         keras.optimizers.SGD(0.1), loss,
                                         host_device=devices[-1])
            record["variable_devices"] = sorted(trainer.variable_bytes_by_device())
        got = [g.numpy() for g in trainer.compute_gradients(x, y)]
        record["max_grad_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
        before = [v.numpy() for v in model.trainable_variables]
        trainer.train_step(x, y)
        trainer.copy_to_model()
        after = [v.numpy() for v in model.trainable_variables]
        record["max_step_diff"] = max(float(np.max(np.abs((b - a) - (-0.1 * g))))
                                      for a, b, g in zip(before, after, want))
    elif mode == "loop":
        with tf.device(devices[-1]):
            v = tf.Variable(tf.ones([1000]))

        @tf.function
        def f() -> tf.Tensor:
            with tf.device(devices[0]):
                a = tf.reduce_sum(v * 2.0)
            return a

        float(f())
        with open(out, "w") as fh:
            json.dump({"running": True}, fh)
        while True:
            float(f())
            time.sleep(0.05)
    elif mode == "alloc":
        with tf.device(devices[0]):
            v = tf.Variable(tf.ones([2**28]))  # 1 GiB of float32
        record["sum"] = float(tf.reduce_sum(v))
    with open(out, "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
