"""The ``batch_count`` scenario of ``tests/mwms_worker.py``, for
``test_train.py::test_every_step_trains_the_global_batch``: counts the examples the replicas
of a 2-worker ``MultiWorkerMirroredStrategy`` train on in one epoch of
``launch.inputs.train_input`` and writes them to ``OUT_DIR/count_<task>.json``."""

import json
import os

import keras
import tensorflow as tf

from launch import inputs


class Count(keras.layers.Layer):
    """Identity that adds its batch size to a per-replica (on-read, sum) counter."""

    def build(self, shape):
        self.n = keras.Variable(0.0, trainable=False, synchronization="on_read",
                                aggregation="sum")

    def call(self, x, training=False):
        if training:
            self.n.assign_add(tf.cast(tf.shape(x)[0], "float32"))
        return x


def run(strategy: tf.distribute.Strategy, out_dir: str) -> None:
    """One epoch of the training input under ``strategy``; writes steps and examples."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    arrays = inputs.load_arrays("digits", "cnn_small", "/nonexistent", None, ["8", "8", "1"],
                                0, 0, 0)
    ds, steps = inputs.train_input(strategy, arrays, 64, 2, index, 0)
    with strategy.scope():
        count = Count()
        model = keras.Sequential([keras.Input(arrays.input_shape), count,
                                  keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    with open(os.path.join(out_dir, f"count_{index}.json"), "w") as fh:
        json.dump({"steps": steps, "examples": float(count.n.numpy())}, fh)
