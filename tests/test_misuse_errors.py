"""Misuse that used to end in TensorFlow's internals gets an error saying what to do: a
custom loop whose first step runs before ``opt.build``, and an inner optimizer created under
another strategy than the wrapper (on 2 real replicas)."""

import keras
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs


def _model_and_batch(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    x = tf.random.stateless_normal((8, 6), seed=(1, 2))
    y = tf.zeros((8,), tf.int32)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))
    return model, batch


def _step(model, opt):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True)) / 2
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step


def test_a_traced_first_step_without_build_says_to_build_first(mirrored2):
    model, batch = _model_and_batch(mirrored2)
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), exchange="allgather")
    run = tf.function(lambda b: mirrored2.run(_step(model, opt), args=b))
    with pytest.raises(ValueError, match=r"opt\.build\(model\.trainable_variables\) inside "
                                         r"strategy\.scope\(\)"):
        run(batch)
    with mirrored2.scope():  # as told: the same loop then trains
        opt.build(model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    run(batch)
    assert any((v.numpy() != b).any() for v, b in zip(model.trainable_variables, before))


def test_an_eager_first_step_builds_by_itself(mirrored2):
    model, batch = _model_and_batch(mirrored2)
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), exchange="allgather")
    mirrored2.run(_step(model, opt), args=batch)
    assert opt.built


def test_an_inner_optimizer_from_outside_the_scope_is_named_at_construction(mirrored2):
    inner = keras.optimizers.SGD(0.05)
    with mirrored2.scope(), pytest.raises(ValueError, match=r"`inner` was created under "
                                                            r"another tf.distribute strategy"):
        tfbs.BlockSparseOptimizer(inner)
    with mirrored2.scope():  # both inside: fine
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05))
