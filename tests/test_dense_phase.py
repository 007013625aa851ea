"""``dense_steps``: the first optimizer steps are ``exchange="dense"``'s, then the configured
exchange takes over with its state moved exactly (2 real replicas)."""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order

STEPS_PER_EPOCH = 4  # 64 examples, batches of 16


def _xy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16 * STEPS_PER_EPOCH, 8, 8, 1)).astype("float32")
    return x, rng.integers(0, 4, len(x)).astype("int32")


def _compiled(strategy, make_opt):
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(4)])
        opt = make_opt()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    return model, opt


class _Record(keras.callbacks.Callback):
    """Every replica's weights and the logged figures after every batch."""

    def __init__(self):
        super().__init__()
        self.weights, self.logs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([[t.numpy() for t in v.value.values]
                             for v in self.model.trainable_variables])
        self.logs.append(dict(logs))


def _fit(strategy, make_opt, epochs=2, callbacks=()):
    model, opt = _compiled(strategy, make_opt)
    record = _Record()
    fit_in_order(model, *_xy(), 16, epochs, callbacks=tfbs.fit_callbacks(
        model, [tfbs.BlockSparseMetrics(update_freq=1), record, *callbacks]))
    return model, opt, record


@functools.cache
def _dense_run(strategy):
    """The reference of every comparison here: ``exchange="dense"`` over SGD with momentum
    0.9, every replica's weights and the logs after each step (run once per module)."""
    return _fit(strategy, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), exchange="dense"))[2]


@pytest.mark.parametrize("mode", ["allgather", pytest.param("shared", marks=pytest.mark.slow)])
def test_dense_steps_are_the_dense_exchange_then_compress(mirrored2, mode):
    """dense_steps=3 over SGD with momentum (moved into momentum correction once sparse):
    steps 1-3 are exchange="dense"'s weights (bit for bit) and bytes, the later ones send
    one block per variable."""
    dense_steps = 3
    dense = _dense_run(mirrored2)
    _, opt, ours = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), k=1, exchange=mode, dense_below=0,
        dense_steps=dense_steps))
    assert opt.momentum_correction == pytest.approx(0.9)  # the sparse exchange's default
    for step in range(dense_steps):
        for a, b in zip(ours.weights[step], dense.weights[step]):
            for x, y in zip(a, b):
                assert np.array_equal(x, y), step
        assert ours.logs[step]["payload_bytes"] == dense.logs[step]["payload_bytes"] == \
            ours.logs[step]["dense_bytes"]
    for step in range(dense_steps, 2 * STEPS_PER_EPOCH):
        assert ours.logs[step]["payload_bytes"] < ours.logs[step]["dense_bytes"] / 3, step
    assert not np.array_equal(ours.weights[-1][0][0], dense.weights[-1][0][0])
    assert not opt.in_dense_phase and int(opt.iterations.numpy()) == 2 * STEPS_PER_EPOCH
    assert any(np.any(r.value.values[0].numpy()) for r in opt.residuals)


@pytest.mark.parametrize("mode", ["allgather", pytest.param("shared", marks=pytest.mark.slow)])
def test_momentum_carries_over_the_switch(mirrored2, mode):
    """Every block sent (density=1.0) with local momentum 0.9 and no masking: the dense
    phase has the momentum in the inner SGD, the sparse one in the velocities; moved at the
    switch, the whole run is momentum SGD's (a lost momentum would show at once)."""
    dense = _dense_run(mirrored2)
    _, opt, ours = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), density=1.0, exchange=mode, dense_below=0,
        momentum_correction=0.9, momentum_masking="none", dense_steps=3))
    for step, (a, b) in enumerate(zip(ours.weights, dense.weights)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x[0], y[0], rtol=1e-5, atol=1e-6, err_msg=str(step))
    assert any(np.any(u.value.values[0].numpy()) for u in opt.velocities)
    assert not any(np.any(m.numpy()) for m in opt.inner_optimizer.momentums)


class _StopAt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("dense_steps", [pytest.param(2, marks=pytest.mark.slow), 6])
def test_a_resumed_run_continues_the_dense_phase_or_the_sparse_one(mirrored2, tmp_path,
                                                                   dense_steps):
    """Interrupted after epoch 0 (4 steps) and resumed from ``tfbs.BackupAndRestore``: past
    the switch (2) the restored velocities stay, before it (6) the resumed run switches at
    step 6; either way it ends with the uninterrupted run's weights."""
    def make_opt():
        return tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), k=1,
                                         exchange="allgather", dense_below=0,
                                         dense_steps=dense_steps)

    straight, _, _ = _fit(mirrored2, make_opt, epochs=3)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(mirrored2, make_opt, epochs=3,
             callbacks=[tfbs.BackupAndRestore(backup), _StopAt(1)])
    resumed, opt, record = _fit(mirrored2, make_opt, epochs=3,
                                callbacks=[tfbs.BackupAndRestore(backup)])
    assert len(record.logs) == 2 * STEPS_PER_EPOCH and not opt.in_dense_phase
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_custom_loop_ends_the_phase_with_update_dense_phase(mirrored2):
    model, opt = _compiled(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), k=1, exchange="allgather", dense_below=0, dense_steps=2))
    with mirrored2.scope():
        opt.build(model.trainable_variables)
    x, y = _xy()

    def make_step():
        @tf.function
        def step():
            def fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                        y[:16], model(x[:16]), from_logits=True)) / 2
                opt.apply(tape.gradient(loss, model.trainable_variables),
                          model.trainable_variables)
            mirrored2.run(fn)
        return step

    step, switched = make_step(), []
    for _ in range(4):
        step()
        switched.append(opt.update_dense_phase())
        if switched[-1]:
            step = make_step()
    assert switched == [False, True, False, False]
    assert opt.block_sparse_metrics()["payload_bytes"] < opt.block_sparse_metrics()[
        "dense_bytes"]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_bad_dense_steps_are_named(bad):
    with pytest.raises(ValueError, match="dense_steps"):
        tfbs.CompressionOptions(dense_steps=bad)
    with pytest.raises(ValueError, match="dense_steps"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), dense_steps=bad)


def test_dense_steps_config_round_trip_and_shells_that_count_no_steps():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), k=2,
                                    exchange="shared", dense_steps=100)
    assert opt.compression.dense_steps == 100 and opt.in_dense_phase
    again = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert again.compression == opt.compression and again.in_dense_phase
    assert tfbs.CompressionOptions(k=2, exchange="shared", dense_steps=100) == opt.compression
    with pytest.raises(ValueError, match="dense_steps"):
        tfbs.BlockSparseCrossDeviceOps(dense_steps=10)


def test_the_optimizer_names_the_callbacks_fit_needs():
    """``opt.fit_callbacks(given)`` and ``tfbs.fit_callbacks(model, given)``: what
    ``model.fit`` needs for the optimizer (found under loss scaling too), none that
    ``given`` holds, none for a fixed exchange without a dense phase or another optimizer;
    an uncompiled model is refused, naming the argument."""
    from tf_blocksparse.keras.fit_loop import find_block_sparse

    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), dense_steps=3)
    assert [type(c) for c in opt.fit_callbacks()] == [tfbs.AutoExchangeCallback,
                                                      tfbs.DensePhaseCallback]
    given = [tfbs.DensePhaseCallback()]
    assert [type(c) for c in opt.fit_callbacks(given)] == [tfbs.AutoExchangeCallback]
    fixed = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="allgather")
    assert fixed.fit_callbacks() == []
    scaled = tfbs.LossScaleOptimizer(opt)
    assert find_block_sparse(scaled) is opt and find_block_sparse(scaled.inner_optimizer) is opt
    assert find_block_sparse(keras.optimizers.SGD(0.1)) is None
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="`model` has no optimizer"):
        tfbs.fit_callbacks(model)
    model.compile(scaled, "mse")
    got = tfbs.fit_callbacks(model, given)
    assert got[0] is given[0] and [type(c) for c in got[1:]] == [tfbs.AutoExchangeCallback]
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert tfbs.fit_callbacks(model, given) == given and tfbs.fit_callbacks(model) == []


def test_a_dense_phase_without_its_callback_warns_once(mirrored2):
    """Fitted without the callbacks it needs, the optimizer warns once, naming the callback
    and what to pass; with them, nothing is said."""
    make = lambda: tfbs.BlockSparseOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.1), exchange="allgather", dense_steps=2)
    model, _ = _compiled(mirrored2, make)
    with pytest.warns(tfbs.MissingFitCallbackWarning, match="DensePhaseCallback.*fit_callbacks"):
        fit_in_order(model, *_xy(), 16, 1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fit_in_order(model, *_xy(), 16, 1)  # once per optimizer
        model, _ = _compiled(mirrored2, make)
        fit_in_order(model, *_xy(), 16, 1, callbacks=tfbs.fit_callbacks(model))
    assert not [w for w in said if issubclass(w.category, tfbs.MissingFitCallbackWarning)]
