"""``gradient_accumulation_steps``: each replica accumulates its micro-steps' gradients
locally and the window's mean is exchanged once, with error feedback unchanged, so n
micro-steps train exactly as one step on their mean (a larger batch) and the bytes per
micro-step fall n-fold.  On 2 real replicas (``MirroredStrategy`` on logical CPUs)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs

WINDOWS = 3


def _grads(micro: int, replica: int, shapes) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * micro + replica)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def _model_and_optimizer(strategy, every, exchange, momentum):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                  keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=momentum),
                                        k=1, dense_below=0, exchange=exchange,
                                        gradient_accumulation_steps=every)
        opt.build(model.trainable_variables)
    return model, opt


def _train(strategy, every, exchange, momentum, grads_of):
    """Applies ``grads_of(step, replica, shapes)`` for WINDOWS * every steps."""
    model, opt = _model_and_optimizer(strategy, every, exchange, momentum)
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    for s in range(WINDOWS * every):
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: tuple(tf.constant(g) for g in
                                   grads_of(s, ctx.replica_id_in_sync_group, shapes))))
    return [v.numpy() for v in variables], opt


def _window_mean(window: int, replica: int, shapes) -> list[np.ndarray]:
    a, b = _grads(2 * window, replica, shapes), _grads(2 * window + 1, replica, shapes)
    return [(x + y) / np.float32(2) for x, y in zip(a, b)]


@pytest.mark.parametrize("exchange,momentum", [("allgather", 0.9), ("shared", 0.0),
                                               ("dense", 0.9)])
def test_two_micro_steps_train_as_one_step_on_their_mean(mirrored2, exchange, momentum):
    want, big = _train(mirrored2, 1, exchange, momentum, _window_mean)
    got, acc = _train(mirrored2, 2, exchange, momentum, _grads)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    if exchange != "dense":  # the residuals (error feedback) are the large batch's
        for a, b in zip(acc.residuals, big.residuals):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(acc.iterations.numpy()) == 2 * WINDOWS  # micro-steps, as Keras counts
    assert int(big.iterations.numpy()) == WINDOWS
    # per training step, the accumulating run hands half the bytes to collectives
    sent, sent_big = (o.block_sparse_metrics(mean=True) for o in (acc, big))
    assert sent["payload_bytes"] == pytest.approx(sent_big["payload_bytes"] / 2)
    assert sent["dense_bytes"] == pytest.approx(sent_big["dense_bytes"])


def test_accumulators_are_per_replica_and_cleared_after_each_exchange(mirrored2):
    _, opt = _train(mirrored2, 3, "allgather", 0.0, _grads)
    assert len(opt._state.accumulators) == 4
    for a in opt._state.accumulators:  # WINDOWS whole windows: every accumulator exchanged
        for local in mirrored2.experimental_local_results(a.value):
            np.testing.assert_array_equal(local.numpy(), 0.0)
    assert opt.gradient_accumulation_steps == 3


def test_a_window_that_is_not_finite_on_one_replica_is_dropped_on_every_one(mirrored2):
    def grads_of(step, replica, shapes):
        out = _grads(step, replica, shapes)
        if step == 2 and replica == 1:  # the second window, one replica only
            out[0][0, 0] = np.inf
        return out

    model, opt = _model_and_optimizer(mirrored2, 2, "allgather", 0.0)
    start = [v.numpy() for v in model.trainable_variables]
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]

    @tf.function
    def step(grads):
        mirrored2.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    def run(s):
        step(mirrored2.experimental_distribute_values_from_function(
            lambda ctx: tuple(tf.constant(g) for g in
                              grads_of(s, ctx.replica_id_in_sync_group, shapes))))

    run(0)
    run(1)
    after_first = [v.numpy() for v in variables]
    assert any(not np.array_equal(a, b) for a, b in zip(after_first, start))
    run(2)
    run(3)  # the window with the inf: skipped everywhere, accumulators cleared
    for a, b in zip(variables, after_first):
        np.testing.assert_array_equal(a.numpy(), b)
    assert opt.block_sparse_metrics()["skipped_steps"] == 1
    for a in opt._state.accumulators:
        for local in mirrored2.experimental_local_results(a.value):
            assert np.isfinite(local.numpy()).all()
            np.testing.assert_array_equal(local.numpy(), 0.0)
    run(4)
    run(5)  # the next window trains again
    assert any(not np.array_equal(a.numpy(), b) for a, b in zip(variables, after_first))


def test_model_fit_accumulates_and_saves_the_setting(mirrored2, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int32")
    model, opt = _model_and_optimizer(mirrored2, 4, "allgather", 0.9)
    with mirrored2.scope():
        model.compile(opt, "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 8
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with mirrored2.scope():
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.gradient_accumulation_steps == 4
    assert loaded.optimizer.get_config()["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4"])
def test_a_bad_gradient_accumulation_steps_is_named(bad):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), gradient_accumulation_steps=bad)


def test_the_inner_optimizers_accumulation_points_to_the_wrapper():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"BlockSparseOptimizer\(SGD\(...\), "
                                         r"gradient_accumulation_steps=4\)"):
        tfbs.BlockSparseOptimizer(inner)


def test_one_micro_step_per_exchange_is_the_plain_wrapper():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1),
                                    gradient_accumulation_steps=1)
    assert opt.gradient_accumulation_steps is None
    assert "gradient_accumulation_steps" not in opt.get_config()


def test_two_processes_accumulate_as_a_larger_batch(mwms_runs):
    """Under MultiWorkerMirroredStrategy the window's condition holds the collectives
    itself (no merge call); both workers agree and match the larger batch bit for bit."""
    import json

    tmp_path = mwms_runs / "accumulation"  # tests/mwms_accumulation_worker.py
    records = [json.loads((tmp_path / f"accumulation_{i}.json").read_text()) for i in range(2)]
    for record in records:
        acc, big = record["accumulated"], record["large_batch"]
        for a, b in zip(acc["weights"], big["weights"]):
            np.testing.assert_array_equal(a, b)
        assert (acc["iterations"], big["iterations"]) == (2 * WINDOWS, WINDOWS)
        assert acc["payload_bytes"] == pytest.approx(big["payload_bytes"] / 2)
        assert record["fit"]["iterations"] == 2 * 128 // 16
        assert all(np.isfinite(record["fit"]["loss"]))
    assert records[0]["fit"]["weights"] == records[1]["fit"]["weights"]
    assert records[0]["accumulated"]["weights"] == records[1]["accumulated"]["weights"]
