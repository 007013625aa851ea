"""Gradients of another dtype than their variables: the wrapper casts them to the variable's
dtype once, at the start of ``apply``, in every exchange mode (as Keras does), on 2 real
replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs

STEPS = 3


def _grads(step: int, replica: int, shapes) -> list[np.ndarray]:
    """float32 numbers (exact in float64 and back) per variable."""
    rng = np.random.default_rng(10 * step + replica)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def _train(strategy, exchange: str, momentum: float, dtype: str) -> list[np.ndarray]:
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=momentum),
                                        k=1, dense_below=0, exchange=exchange)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    for s in range(STEPS):
        grads = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: tuple(tf.constant(g, dtype) for g in
                                   _grads(s, ctx.replica_id_in_sync_group, shapes)))
        step(grads)
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("exchange", ["allgather", "shared", "dense"])
def test_float64_gradients_train_float32_variables_as_float32_ones(mirrored2, exchange,
                                                                   momentum):
    """Without momentum error feedback adds the gradient to a float32 residual; with it
    (moved before a sparse exchange) the float32 local momentum scales it first."""
    want = _train(mirrored2, exchange, momentum, "float32")
    got = _train(mirrored2, exchange, momentum, "float64")
    for a, b in zip(got, want):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
