"""BlockSparseOptimizer behaviour in model.fit and custom loops (2 real replicas)."""

import functools
import os
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order


def _cnn() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(4),
    ])


def _xy(n=64):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 8, 8, 1)).astype("float32")
    return x, rng.integers(0, 4, n).astype("int32")


def _fit(strategy, make_opt, epochs=1, model_fn=_cnn, data=None, **fit_kwargs):
    """A compiled ``model_fn()`` under ``make_opt()``, fitted ``epochs`` on ``data`` (default
    :func:`_xy`) in order, batches of 16; ``fit_kwargs`` go to ``model.fit``."""
    with strategy.scope():
        model = model_fn()
        opt = make_opt()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    hist = fit_in_order(model, *(data if data is not None else _xy()), 16, epochs,
                        **fit_kwargs)
    return model, opt, hist


@functools.cache
def plain_sgd_weights(strategy) -> list:
    """The weights after one epoch of :func:`_fit` with Keras' plain ``SGD(0.1,
    momentum=0.9)`` (4 steps; trained once per process, read only)."""
    return _fit(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.9))[0].get_weights()


def test_dense_exchange_is_bit_identical_to_plain_sgd(mirrored2):
    ours, opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), exchange="dense"))
    for a, b in zip(plain_sgd_weights(mirrored2), ours.get_weights()):
        assert np.array_equal(a, b)
    assert opt.block_sparse_metrics()["payload_bytes"] == opt.block_sparse_metrics()[
        "dense_bytes"]


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_replica_weights_identical_residuals_differ(mirrored2, mode):
    model, opt, hist = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), k=1, exchange=mode, dense_below=0),
        epochs=2)
    for v in model.trainable_variables:
        a, b = (t.numpy() for t in v.value.values)
        assert np.array_equal(a, b), v.path
    differ = [not np.array_equal(*(t.numpy() for t in r.value.values)) for r in opt.residuals]
    assert all(differ)
    m = opt.block_sparse_metrics()
    # conv kernel 3x3x1x6, bias 6, dense kernel 216x4, bias 4; one block each.
    values = 4 * (9 + 1 + 216 + 1)
    side = 4 * (4 + 1) if mode == "allgather" else 4 * (6 + 6 + 4 + 4)  # ids+flag | scores
    assert m["payload_bytes"] == values + side
    assert m["dense_bytes"] == 4 * (54 + 6 + 864 + 4)
    assert m["blocks_kept"] == len(model.trainable_variables)
    assert m["residual_norm"] > 0 and m["skipped_steps"] == 0
    assert np.isfinite(hist.history["loss"]).all()


def test_block_sparse_training_reduces_loss(mirrored2):
    _, _, hist = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.25, dense_below=0,
        exchange="allgather"), epochs=6)
    loss = hist.history["loss"]
    assert loss[-1] < loss[0] * 0.9, loss


def test_keras_save_load_round_trip(mirrored2, tmp_path):
    model, opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.5, metric="l2", exchange="shared",
        momentum_correction=None, dense_below=0))
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    with mirrored2.scope():
        loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert isinstance(lopt, tfbs.BlockSparseOptimizer)
    assert (lopt.k, lopt.density, lopt.metric, lopt.exchange) == (None, 0.5, "l2", "shared")
    assert isinstance(lopt.inner_optimizer, keras.optimizers.SGD)
    assert lopt.inner_optimizer.momentum == 0.9
    assert int(lopt.iterations.numpy()) == int(opt.iterations.numpy())
    # A checkpoint holds the sum over replicas; on load each replica gets sum / N.
    for a, b in zip(opt.residuals, lopt.residuals):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
        halves = [t.numpy() for t in b.value.values]
        np.testing.assert_allclose(halves[0], a.numpy() / 2, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        assert np.array_equal(a, b)
    loaded.fit(*_xy(32), batch_size=16, epochs=1, verbose=0)  # keeps training


def test_config_round_trip():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.Adam(1e-3), k=3, metric="l2",
                                    exchange="shared", block_rules={"dense": "single"})
    again = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)


def test_learning_rate_is_delegated():
    inner = keras.optimizers.SGD(0.1)
    opt = tfbs.BlockSparseOptimizer(inner, exchange="allgather")
    opt.learning_rate = 0.25
    assert float(np.asarray(inner.learning_rate)) == pytest.approx(0.25)
    assert opt.k == 1 and opt.density is None


@pytest.mark.parametrize("kwargs, name", [
    ({"k": 0}, "`k`"), ({"k": 2.5}, "`k`"), ({"k": True}, "`k`"),
    ({"density": 0.0}, "`density`"), ({"density": 1.5}, "`density`"),
    ({"density": -0.1}, "`density`"), ({"k": 2, "density": 0.5}, "`k` and `density`"),
    ({"metric": "linf"}, "`metric`"), ({"exchange": "ring"}, "`exchange`"),
    ({"nonfinite": "zero"}, "`nonfinite`"), ({"block_rules": {"x": "rows"}}, "block_rules"),
    ({"clipnorm": 1.0}, "clipnorm"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), **kwargs)


@pytest.mark.parametrize("inner", [object(), "sgd",
                                   keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())])
def test_bad_inner_is_a_type_error(inner):
    with pytest.raises(TypeError, match="`inner`"):
        tfbs.BlockSparseOptimizer(inner, exchange="allgather")


def test_embedding_indexed_slices(mirrored2):
    def model_fn():
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((5,), dtype="int32"),
                                 keras.layers.Embedding(50, 8), keras.layers.Flatten(),
                                 keras.layers.Dense(4)])

    rng = np.random.default_rng(0)
    data = (rng.integers(0, 50, (64, 5)).astype("int32"), rng.integers(0, 4, 64).astype("int32"))
    before = model_fn().get_weights()[0]
    model, opt, hist = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), k=2, dense_below=0,
        exchange="allgather"), model_fn=model_fn, data=data)
    emb_layout = opt.layouts[0]
    assert emb_layout.rule.name == "row" and emb_layout.num_blocks == 50
    changed = np.flatnonzero(np.any(model.get_weights()[0] != before, axis=1))
    # 4 steps x 2 replicas x k=2 rows at most.
    assert 1 <= len(changed) <= 16
    assert np.isfinite(hist.history["loss"]).all()


def _custom_loop(strategy, opt_fn, poison_replica=None, steps=2):
    with strategy.scope():
        model = _cnn()
        opt = opt_fn()
        opt.build(model.trainable_variables)
    x, y = _xy(8)

    @tf.function
    def train(poison):
        def step():
            ctx = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                logits = model(x)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, logits, from_logits=True)) / ctx.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            bad = tf.logical_and(poison, tf.equal(ctx.replica_id_in_sync_group,
                                                  poison_replica or 0))
            grads[0] = tf.where(bad, grads[0] * np.nan, grads[0])
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(step)

    for _ in range(steps):
        train(tf.constant(False))
    return model, opt, train


@pytest.mark.parametrize("mode", ["allgather", "shared", "dense"])
def test_nonfinite_gradient_skips_step_on_every_replica(mirrored2, mode):
    model, opt, train = _custom_loop(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), k=1, exchange=mode, dense_below=0,
        momentum_correction=None), poison_replica=1)
    _assert_poisoned_step_is_skipped(model, opt, train)


@pytest.mark.parametrize("mode", ["allgather", "shared"])
@pytest.mark.parametrize("dense_below", [100, 10**6])
def test_nonfinite_whole_variable_skips_step_on_every_replica(mirrored2, mode, dense_below):
    """A NaN in replica 1's conv kernel (54 elements, sent whole) skips the step on both
    replicas, beside the compressed Dense kernel (100) or with every variable whole."""
    model, opt, train = _custom_loop(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), k=1, exchange=mode, dense_below=dense_below),
        poison_replica=1)
    _assert_poisoned_step_is_skipped(model, opt, train)


def _assert_poisoned_step_is_skipped(model, opt, train):
    """One step with replica 1's first gradient NaN leaves everything as it was."""
    weights = [[t.numpy() for t in v.value.values] for v in model.trainable_variables]
    residuals = [[t.numpy() for t in r.value.values] for r in opt.residuals]
    velocities = [[t.numpy() for t in u.value.values] for u in opt.velocities]
    moments = [v.numpy() for v in opt.inner_optimizer.variables]
    it = int(opt.iterations.numpy())
    train(tf.constant(True))
    for u, before in zip(opt.velocities, velocities):  # local momentum (the default) too
        for t, b in zip(u.value.values, before):
            assert np.array_equal(t.numpy(), b)
    for v, before in zip(model.trainable_variables, weights):
        for t, b in zip(v.value.values, before):
            assert np.array_equal(t.numpy(), b)
    for r, before in zip(opt.residuals, residuals):
        for t, b in zip(r.value.values, before):
            assert np.array_equal(t.numpy(), b) and np.isfinite(t.numpy()).all()
    for v, b in zip(opt.inner_optimizer.variables, moments):
        assert np.array_equal(v.numpy(), b)
    assert int(opt.iterations.numpy()) == it
    assert opt.block_sparse_metrics()["skipped_steps"] == 1
    train(tf.constant(False))  # training resumes
    assert int(opt.iterations.numpy()) == it + 1


@pytest.mark.parametrize("mode", ["allgather", "shared"])
@pytest.mark.parametrize("dense_below", [100, 10**6])
def test_payload_bytes_with_whole_variables(mirrored2, mode, dense_below):
    _, opt, _ = _custom_loop(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), k=1, exchange=mode, dense_below=dense_below), steps=1)
    m = opt.block_sparse_metrics()
    assert m["dense_bytes"] == 4 * (54 + 6 + 864 + 4)
    if dense_below == 10**6:  # all whole: one dense sum, no ids, scores or flag
        assert m["payload_bytes"] == m["dense_bytes"]
        return
    # dense_below=100: the Dense kernel (4 blocks of 216) keeps one block; the conv kernel
    # (54) and both biases (6, 4) are summed whole, without ids or scores.
    whole = 4 * (54 + 6 + 4)
    side = 4 * (1 + 1) if mode == "allgather" else 4 * 4  # id + flag | scores
    assert m["payload_bytes"] == side + 4 * 216 + whole
    assert m["blocks_kept"] == 6 + 6 + 1 + 4


def test_no_strategy_custom_loop_and_loss_scale_outside():
    model = _cnn()
    opt = keras.optimizers.LossScaleOptimizer(tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), k=2, dense_below=0, exchange="allgather"))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    hist = model.fit(*_xy(), batch_size=16, epochs=3, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert opt.inner_optimizer.block_sparse_metrics()["blocks_kept"] == 8


@pytest.mark.parametrize("update_freq", ["epoch", 1])
def test_metrics_callback_logs_and_tensorboard(mirrored2, tmp_path, update_freq):
    with mirrored2.scope():
        model = _cnn()
        model.compile(optimizer=tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), k=1,
                                                          dense_below=0, exchange="allgather"),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = tfbs.BlockSparseMetrics(log_dir=str(tmp_path), update_freq=update_freq)
    seen = []

    class BatchLogs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append("payload_bytes" in (logs or {}))

    hist = fit_in_order(model, *_xy(), 16, 2, callbacks=[cb, BatchLogs()])
    assert all(seen) if update_freq == 1 else not any(seen)  # batch logs: read per batch
    for name in ("payload_bytes", "dense_bytes", "compression", "blocks_kept",
                 "residual_norm", "skipped_steps"):
        assert name in hist.history, name
    assert hist.history["compression"][-1] == pytest.approx(
        hist.history["dense_bytes"][-1] / hist.history["payload_bytes"][-1])
    assert hist.history["compression"][-1] > 3
    events = list((tmp_path / "block_sparse").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    for bad in (0, True, "batch", 1.0):
        with pytest.raises(ValueError, match="update_freq"):
            tfbs.BlockSparseMetrics(update_freq=bad)


def test_optimizer_finds_layer_classes_of_renamed_layers():
    model = keras.Sequential([
        keras.Input((6, 6, 3)), keras.layers.Conv2DTranspose(5, 3, name="up"),
        keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="dw"),
        keras.layers.Flatten(), keras.layers.Dense(4, name="head")])
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="allgather")
    opt.build(model.trainable_variables)
    by_path = {lay.path.split("/", 1)[1]: lay for lay in opt.layouts}
    up = by_path["up/kernel"]  # kernel (3, 3, 5, 3): filters are axis -2
    assert (up.rule.name, up.num_blocks, up.block_size) == ("transpose_filter", 5, 27)
    dw = by_path["dw/kernel"]  # (3, 3, 5, 2): one block per (channel, multiplier)
    assert (dw.rule.name, dw.num_blocks, dw.block_size) == ("depthwise_channel", 10, 9)
    assert by_path["head/kernel"].num_blocks == 4
    assert all(lay.layer_class for lay in opt.layouts)


def test_element_granularity_is_elementwise_topk(mirrored2):
    model, opt, hist = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), density=0.05, granularity="element",
        dense_below=0, exchange="allgather"))
    m = opt.block_sparse_metrics()
    # ceil(5% of each variable's elements): 54 -> 3, 6 -> 1, 864 -> 44, 4 -> 1; int32 id each.
    kept = 3 + 1 + 44 + 1
    assert m["blocks_kept"] == kept
    assert m["payload_bytes"] == 4 * (kept + 1) + 4 * kept
    for r in opt.residuals:  # exactly `kept` entries were zeroed per replica
        for t in r.value.values:
            assert np.count_nonzero(t.numpy() == 0) >= 1
    with pytest.raises(ValueError, match="`granularity`"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(), granularity="row", exchange="allgather")


def test_dense_on_rank3_input_gradient_with_unknown_static_shape():
    keras.utils.set_random_seed(0)
    inp = keras.Input((None, 6))
    model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(5)(inp)))
    model.compile(optimizer=tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1,
                                                      exchange="allgather"),
                  loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4, 6)).astype("float32")
    hist = model.fit(x, rng.standard_normal((32, 4, 3)).astype("float32"), epochs=2,
                     batch_size=8, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()


def train_lazily(model, opt, steps=2):
    """Steps of a tf.function whose first trace builds ``opt`` (inputs [2, 4])."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for _ in range(steps):
        step(tf.ones((2, 4)))
    assert int(opt.iterations.numpy()) == steps


def test_a_custom_loop_does_not_autograph_convert_the_library(monkeypatch):
    """A user's tf.function (AutoGraph on, the default) that calls ``opt.apply`` runs the
    library's step as written, as Keras' own steps do: converting the whole call tree
    costs seconds at the first trace.  A converted frame runs from AutoGraph's generated
    file under the name ``tf__<name>``."""
    from tf_blocksparse.keras import optimizer_step

    stacks = []
    real = optimizer_step.apply_inner

    def spy(*args, **kwargs):
        stacks.append([(f.filename, f.name) for f in traceback.extract_stack()])
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_step, "apply_inner", spy)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, exchange="allgather")
    train_lazily(model, opt, steps=1)
    assert stacks  # traced (twice: the first trace creates the optimizer's variables)
    for stack in stacks:
        assert any(name == "tf__step" for _, name in stack)  # the user's function: converted
        assert ("apply" in {name for path, name in stack if "tf_blocksparse" in path})
        assert [name for _, name in stack if name.startswith("tf__")] == ["tf__step"]


def test_built_lazily_inside_a_tf_function():
    # apply() may build the optimizer while a tf.function traces (owner discovery must not
    # be autograph-converted).
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    train_lazily(model, tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1,
                                                  exchange="allgather"))
