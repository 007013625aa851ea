"""BlockSparseCrossDeviceOps under MirroredStrategy: parity with the optimizer wrapper."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs

_STRATEGIES: dict = {}


def _strategy(kind: str, **kwargs):
    """One MirroredStrategy per ops configuration (TF shares collective keys otherwise)."""
    key = (kind, tuple(sorted(kwargs.items())))
    if key not in _STRATEGIES:
        ops = tfbs.BlockSparseCrossDeviceOps(**kwargs) if kind == "ops" else None
        _STRATEGIES[key] = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                          cross_device_ops=ops), ops)
    return _STRATEGIES[key]


def _model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(5, 3, name="c"),
                             keras.layers.Flatten(), keras.layers.Dense(3, name="d")])


def _data():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((64, 8, 8, 1)).astype("float32"),
            rng.integers(0, 3, 64).astype("int32"))


def _fit(strategy, opt_fn, ops=None):
    with strategy.scope():
        model = _model()
        if ops is not None:
            ops.bind_model(model)
        model.compile(optimizer=opt_fn(), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(*_data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, hist


@pytest.mark.parametrize("exchange", ["allgather", "shared"])
def test_same_weights_as_the_optimizer_wrapper(mirrored2, exchange):
    strategy, ops = _strategy("ops", k=1, exchange=exchange)
    via_ops, hist = _fit(strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9), ops)
    via_opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), k=1, exchange=exchange))
    for a, b in zip(via_ops.get_weights(), via_opt.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(via_ops.get_weights()[0], _model().get_weights()[0])
    # metrics (accuracy) and losses still reduce densely
    assert 0.0 <= hist.history["accuracy"][-1] <= 1.0
    assert ops.payload_bytes < ops.dense_bytes / 2
    residuals = next(iter(ops.residuals.values()))
    assert len(residuals) == 2 and len(residuals[0]) == 4
    assert not np.array_equal(residuals[0][0].numpy(), residuals[1][0].numpy())


def test_non_gradient_reductions_pass_through():
    strategy, _ = _strategy("ops", density=0.5)
    ints = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group + 1, 10]))
    assert strategy.reduce("SUM", ints, axis=None).numpy().tolist() == [3, 20]
    floats = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([1.0, 2.0]) * tf.cast(ctx.replica_id_in_sync_group + 1,
                                                      tf.float32))
    assert strategy.reduce("MEAN", floats, axis=None).numpy().tolist() == [1.5, 3.0]


@pytest.mark.parametrize("kwargs, name", [({"k": 0}, "`k`"), ({"metric": "max"}, "`metric`"),
                                          ({"exchange": "dense"}, "`exchange`"),
                                          ({"granularity": "row"}, "`granularity`")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tfbs.BlockSparseCrossDeviceOps(**kwargs)


def test_bind_model_needs_a_model():
    with pytest.raises(TypeError, match="`model`"):
        tfbs.BlockSparseCrossDeviceOps().bind_model(object())


@pytest.mark.parametrize("buffer_bytes", [64, 2000, 10**6])
def test_fused_ops_bit_identical_to_default_reduction(mirrored2, buffer_bytes):
    key = ("fused", buffer_bytes)
    if key not in _STRATEGIES:
        ops = tfbs.FusedCrossDeviceOps(buffer_bytes=buffer_bytes)
        _STRATEGIES[key] = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                           cross_device_ops=ops), ops)
    fused, ops = _STRATEGIES[key]
    plain = mirrored2  # the default (collective) reduction; one such strategy per process
    a, _ = _fit(fused, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    b, _ = _fit(plain, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    for x, y in zip(a.get_weights(), b.get_weights()):
        assert np.array_equal(x, y)
    # backward order: dense bias 12 B, dense kernel 2160 B, conv bias 20 B, conv kernel 180 B
    assert ops.collectives_per_step == {64: 4, 2000: 3, 10**6: 1}[buffer_bytes]


def test_fused_ops_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        tfbs.FusedCrossDeviceOps()
    with pytest.raises(ValueError, match="`buffer_bytes`"):
        tfbs.FusedCrossDeviceOps(buffer_bytes=0)
