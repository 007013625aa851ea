"""The replica type both step-based trainers use: copies, placement, forward, state averaging."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_blocksparse.runtime.replica import Replica, average_state, clone_optimizer

CPUS = ["/cpu:0", "/cpu:1"]


class Counter(keras.layers.Layer):
    """Counts its calls in an integer non-trainable variable (and has no ``training`` arg)."""

    def build(self, input_shape: tuple) -> None:
        self.count = self.add_weight(shape=(), dtype="int32", initializer="zeros",
                                     trainable=False, name="count")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        self.count.assign(self.count + 1)
        return x


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(5, name="d1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = Counter(name="counter")(h)
    out = keras.layers.Dense(3, name="d2")(h)
    return keras.Model(inputs, out)


def _chain(model: keras.Model) -> list[keras.layers.Layer]:
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _x(rows: int = 4, seed: int = 0) -> tf.Tensor:
    return tf.constant(np.random.default_rng(seed).normal(size=(rows, 6)), tf.float32)


def test_layers_and_model_pieces_copy_the_same_variables() -> None:
    model = _model()
    by_layers, by_model = Replica(_chain(model), CPUS[1]), Replica(model, CPUS[1])
    assert [v.path for v in by_layers.trainable_refs] == \
        [v.path for v in by_model.trainable_refs] == [v.path for v in model.trainable_variables]
    assert [v.path for v in by_layers.non_trainable_refs] == \
        [v.path for v in by_model.non_trainable_refs]
    assert by_layers.owners == ["d1", "d1", "bn", "bn", "d2", "d2"]
    assert by_layers.var_devices == [CPUS[1]] * 6
    for rep in (by_layers, by_model):
        for ref, copy in zip(rep.trainable_refs + rep.non_trainable_refs,
                             rep.trainable + rep.non_trainable):
            assert copy is not ref and "CPU:1" in copy.value.device
            np.testing.assert_array_equal(copy.numpy(), ref.numpy())
    # both run the same function of the input
    y1, _ = by_layers.forward(_x())
    y2, _ = by_model.forward(_x())
    np.testing.assert_allclose(y1.numpy(), y2.numpy(), rtol=1e-6)
    np.testing.assert_allclose(y1.numpy(), model(_x(), training=True).numpy(), rtol=1e-6)


def test_copies_are_owned_and_written_back() -> None:
    model = _model()
    rep = Replica(_chain(model), CPUS[0])
    before = [v.numpy() for v in model.trainable_variables]
    rep.trainable[0].assign(rep.trainable[0] + 1.0)
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), before[0])  # no alias
    rep.copy_to_refs()
    np.testing.assert_array_equal(model.trainable_variables[0].numpy(), before[0] + 1.0)


def test_device_of_layer_places_a_layers_copies() -> None:
    model = _model()
    rep = Replica(model, CPUS[0], lambda name: CPUS[1] if name == "bn" else CPUS[0])
    assert rep.var_devices == [CPUS[0], CPUS[0], CPUS[1], CPUS[1], CPUS[0], CPUS[0]]
    for copy, dev in zip(rep.trainable, rep.var_devices):
        assert dev[-5:].upper() in copy.value.device
    bn_state = [i for i, v in enumerate(rep.non_trainable_refs) if "bn" in v.path]
    assert len(bn_state) == 2 and len(rep.non_trainable) == 3  # moving mean, variance; count
    for i, copy in enumerate(rep.non_trainable):
        want = "CPU:1" if i in bn_state else "CPU:0"
        assert rep.state_devices[i][-5:].upper() == want and want in copy.value.device


def test_forward_threads_state_without_assigning_it() -> None:
    model = _model()
    rep = Replica(_chain(model), CPUS[0])
    initial = [v.numpy() for v in rep.non_trainable]
    _, state1 = rep.forward(_x(seed=1))
    _, state2 = rep.forward(_x(seed=2), state1)  # the next micro-batch starts from state1
    for var, value in zip(rep.non_trainable, initial):
        np.testing.assert_array_equal(var.numpy(), value)  # nothing assigned
    mean = [i for i, v in enumerate(rep.non_trainable_refs) if "moving_mean" in v.path][0]
    assert np.any(state1[mean].numpy() != initial[mean])
    assert np.any(state2[mean].numpy() != state1[mean].numpy())
    assert [int(state1[-1]), int(state2[-1])] == [1, 2]  # the counter went on from state1


def test_average_state_means_floats_and_keeps_the_first_of_the_rest() -> None:
    model = _model()
    reps = [Replica(model, dev) for dev in CPUS]
    states = [rep.forward(_x(seed=s))[1] for s, rep in enumerate(reps)]
    floating = [tf.as_dtype(v.dtype).is_floating for v in reps[0].non_trainable]
    assert floating == [True, True, False]  # BatchNorm statistics and the call counter
    states[1] = [s if f else s + tf.ones_like(s) for s, f in zip(states[1], floating)]
    average_state(reps, states)
    for i, f in enumerate(floating):
        want = (states[0][i] + states[1][i]).numpy() / 2 if f else states[0][i].numpy()
        for rep in reps:
            np.testing.assert_allclose(rep.non_trainable[i].numpy(), want, rtol=1e-6)


def test_clone_optimizer() -> None:
    sgd = keras.optimizers.SGD(0.25, momentum=0.5)
    made = clone_optimizer(sgd)
    assert made is not sgd and isinstance(made, keras.optimizers.SGD)
    assert made.get_config() == sgd.get_config()
    assert isinstance(clone_optimizer(lambda: keras.optimizers.Adam(0.1)), keras.optimizers.Adam)
    for bad in ("sgd", lambda: "sgd"):
        with pytest.raises(ValueError, match="optimizer"):
            clone_optimizer(bad)
