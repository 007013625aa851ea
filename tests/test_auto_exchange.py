"""exchange="auto" in BlockSparseOptimizer on two real MirroredStrategy replicas, and the
dense exchange's residual flush against a NumPy reference."""

import collections
import functools
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order
from tf_blocksparse import blocks
from tf_blocksparse.auto.auto_callback import remeasure_gap
from tf_blocksparse.auto.auto_exchange import fallback_mode
from tf_blocksparse.exchange import run_exchange
from tf_blocksparse.feedback import BlockTopK
from tf_blocksparse.keras.momentum import mask_sent

X = np.random.default_rng(0).standard_normal((32, 6)).astype("float32")


def _linear_fit(strategy, exchange, epochs, modes=None):
    """A bias-free Dense(16) under ``loss = sum(outputs)``, 2 steps of SGD(0.1) per epoch: every
    step's gradient is the same (it does not depend on the weights), so error feedback's
    bookkeeping is checkable exactly.  ``modes`` forces the groups' modes after the build.
    Returns the model, the optimizer and the initial kernel."""
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, use_bias=False)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange=exchange, k=2,
                                        dense_below=0)
        model.compile(opt, loss=lambda y, p: tf.reduce_sum(p, axis=-1))
    initial = model.get_weights()[0]
    if modes is not None:
        with strategy.scope():
            opt.build(model.trainable_variables)
        opt.exchange_chooser.set_modes(modes)
    model.fit(X, np.zeros((32,), "float32"), batch_size=16, epochs=epochs, verbose=0,
              shuffle=False)
    return model, opt, initial


def _linear_dense_reference(initial, epochs):
    """NumPy: :func:`_linear_fit`'s kernel after ``epochs`` of the dense exchange.  The
    global batch's mean gradient of ``sum(x @ W)`` is the batch's mean ``x`` in every
    column; the two batches of an epoch together take ``2 * 0.1 * mean(X)``."""
    step = 2 * 0.1 * X.astype("float64").mean(axis=0)
    return initial - epochs * step[:, None]


# Heavy (~18 s): `make test-slow` (CI runs it); the fast suite keeps the same conservation
# with momentum (test_switch_to_dense_applies_residuals_once_and_moves_the_momentum).
@pytest.mark.slow
def test_switching_to_dense_flushes_residuals_nothing_lost(mirrored2):
    model, opt, initial = _linear_fit(mirrored2, "auto", 2, modes=["allgather"])
    residual = opt.residuals[0].numpy()  # summed over replicas
    assert np.abs(residual).sum() > 0  # blocks were held back: the weights differ
    assert not np.allclose(model.get_weights()[0], _linear_dense_reference(initial, 2),
                           atol=1e-5)
    # what was sent plus what is held is exactly the dense exchange's update
    np.testing.assert_allclose(model.get_weights()[0] - 0.1 * residual,
                               _linear_dense_reference(initial, 2), rtol=1e-5, atol=1e-6)
    opt.exchange_chooser.set_modes(["dense"])  # then one more epoch, dense
    model.make_train_function(force=True)
    model.fit(X, np.zeros((32,), "float32"), batch_size=16, epochs=1, verbose=0,
              shuffle=False)
    assert opt.residuals[0].numpy() == pytest.approx(0.0)
    np.testing.assert_allclose(model.get_weights()[0], _linear_dense_reference(initial, 3),
                               rtol=1e-5, atol=1e-6)
    dense, _, _ = _linear_fit(mirrored2, "dense", 1)  # the reference is the library's dense
    np.testing.assert_allclose(dense.get_weights()[0], _linear_dense_reference(initial, 1),
                               rtol=1e-5, atol=1e-6)


def test_dense_exchange_with_state_sends_grad_plus_residual():
    lay = blocks.BlockLayout("w", (3, 4), blocks.OUTPUT_CHANNEL, None)
    comp = BlockTopK([lay], k=1, dense_below=0)
    g = np.arange(12, dtype="float32").reshape(3, 4)
    s = np.ones((3, 4), "float32") * 0.5
    ctx = tf.distribute.get_replica_context()
    r = run_exchange("dense", ctx, comp, [tf.constant(g)], [tf.constant(s)])
    np.testing.assert_array_equal(r.updates[0].numpy(), g + s)
    np.testing.assert_array_equal(r.residuals[0].numpy(), np.zeros((3, 4)))
    assert r.sent_ids is None
    plain = run_exchange("dense", ctx, comp, [tf.constant(g)], None)
    assert plain.residuals is None
    np.testing.assert_array_equal(plain.updates[0].numpy(), g)


def test_dense_variables_keep_their_momentum():
    lay = blocks.BlockLayout("w", (2, 3), blocks.OUTPUT_CHANNEL, None)
    u = tf.ones((2, 3))
    kept, masked = mask_sent([u, u], [lay, lay], [None, tf.constant([1], tf.int32)])
    np.testing.assert_array_equal(kept.numpy(), np.ones((2, 3)))
    assert masked.numpy()[:, 1].sum() == 0 and masked.numpy().sum() == 4


def _fit_auto(strategy, policy, **kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                        exchange=policy, density=0.1, **kwargs)
        model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    y = (X[:, 0] > 0).astype("int32")
    callback = tfbs.AutoExchangeCallback()
    fit_in_order(model, X, y, 8, 3, callbacks=[callback])
    return opt, callback


def test_fit_measures_decides_and_reports(mirrored2):
    policy = tfbs.AutoExchange(warmup_steps=4, remeasure_steps=4, measure_budget=None)
    opt, callback = _fit_auto(mirrored2, policy, fusion_buffer_bytes=1024)
    decision = opt.exchange_decision
    assert decision is not None and len(decision.modes) >= 2
    assert [step for step, _ in callback.decisions] == [4, 8, 12]
    initial = callback.initial  # build time: no step timed yet, the prior stands in
    assert initial is not None and initial.compute_s == pytest.approx(
        policy.prior_compute_s(initial.groups))
    assert decision.compute_s > 0 and decision.link.sum_latency_s >= 0
    m = opt.block_sparse_metrics()
    for key in ("auto_sparse_groups", "auto_dense_groups", "auto_sum_latency_ms",
                "auto_compute_ms", "auto_predicted_step_ms", "exchange_s"):
        assert key in m, key
    assert m["auto_sparse_groups"] + m["auto_dense_groups"] == len(decision.modes)
    assert m["exchange_s"] > 0 and m["exchange_s_total"] >= m["exchange_s"]


def test_remeasuring_keeps_within_its_budget_of_the_training_time(mirrored2):
    """After a re-measurement the next one waits until measuring is at most
    ``measure_budget`` of the (predicted) training time, and never less than
    ``remeasure_steps``; the first re-decision re-measures nothing and keeps the gap."""
    decision = types.SimpleNamespace(step_s=0.01)
    policy = tfbs.AutoExchange(remeasure_steps=4)  # budget 1%
    assert remeasure_gap(policy, mirrored2, decision, 0.5) == 5000  # 0.5 s / (1% of 10 ms)
    # with 8 steps per exchange the decision's 10 ms is a window's: 5000 windows
    assert remeasure_gap(policy, mirrored2, decision, 0.5, steps_per_exchange=8) == 40000
    assert remeasure_gap(policy, mirrored2, decision, 1e-6) == 4
    assert remeasure_gap(policy, mirrored2, decision, None) == 4
    assert remeasure_gap(policy, mirrored2, None, 0.5) == 4
    unlimited = tfbs.AutoExchange(remeasure_steps=4, measure_budget=None)
    assert remeasure_gap(unlimited, mirrored2, decision, 0.5) == 4
    never = tfbs.AutoExchange(remeasure_steps=0)
    assert remeasure_gap(never, mirrored2, decision, 0.5) == float("inf")
    # in fit: step 4 re-decides with the build-time figures, step 8 re-measures (tens of
    # milliseconds against a step of about a millisecond), then nothing within the run
    tight = tfbs.AutoExchange(warmup_steps=4, remeasure_steps=4, measure_budget=0.01)
    _, callback = _fit_auto(mirrored2, tight, fusion_buffer_bytes=1024)
    assert [step for step, _ in callback.decisions] == [4, 8]


def test_the_callback_weighs_a_switch_against_the_steps_left(mirrored2):
    """The re-decisions get the steps still to train and the first step's extra time (what
    a re-trace costs), so a change that cannot pay for its re-trace is not made."""
    seen = []

    class Recording(tfbs.AutoExchangeCallback):
        def on_train_batch_end(self, batch, logs=None):
            chooser = self._opt().exchange_chooser
            if not hasattr(chooser, "recorded"):
                real = chooser.decide

                def decide(*args, **kwargs):
                    seen.append(kwargs)
                    return real(*args, **kwargs)

                chooser.decide, chooser.recorded = decide, True
            super().on_train_batch_end(batch, logs)

    with mirrored2.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), density=0.1,
                                        exchange=tfbs.AutoExchange(warmup_steps=3,
                                                                   remeasure_steps=0))
        model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = len(X) // 8
    fit_in_order(model, X, (X[:, 0] > 0).astype("int32"), 8, 2, callbacks=[Recording()])
    assert len(seen) == 1 and seen[0]["steps_left"] == 2 * steps - 3
    assert seen[0]["switch_s"] > 0  # the first step traced


@functools.cache
def _one_candidate_fit(strategy, candidates):
    """What the tests read of :func:`_fit_auto` under ``AutoExchange(candidates=candidates)``
    with ``dense_below=0``, over several fusion groups (trained once per module: the
    ``("allgather",)`` run is read by two tests)."""
    opt, callback = _fit_auto(strategy, tfbs.AutoExchange(candidates=candidates),
                              dense_below=0, fusion_buffer_bytes=1024)
    chooser = opt.exchange_chooser
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.optimizer = opt
    return types.SimpleNamespace(
        metrics=dict(opt.block_sparse_metrics()), groups=len(chooser.groups),
        modes=list(chooser.modes), decision=opt.exchange_decision,
        decisions=list(callback.decisions), probes=dict(chooser._probe_cache),
        has_residuals=opt.residuals != [], fit_callbacks=tfbs.fit_callbacks(model))


@pytest.mark.parametrize("candidates,sparse", [(("allgather",), True), (("dense",), False)])
def test_one_candidate_is_used_everywhere_and_nothing_is_measured(mirrored2, candidates,
                                                                   sparse):
    run = _one_candidate_fit(mirrored2, candidates)
    m = run.metrics
    assert (m["payload_bytes"] < m["dense_bytes"]) == sparse
    assert run.groups >= 2 and run.modes == list(candidates) * run.groups
    # no choice to make: no decision, no re-decisions, no compression probe, no auto_* figures
    assert run.decision is None and run.decisions == []
    assert run.probes == {} and not any(k.startswith("auto_") for k in m)
    assert run.has_residuals == sparse  # dense for good: no state, as exchange="dense"
    assert run.fit_callbacks == []  # fit needs no callback for it
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.optimizer = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1))  # the default
    assert [type(c) for c in tfbs.fit_callbacks(model)] == [tfbs.AutoExchangeCallback]


def test_a_recurrent_model_stays_dense_and_nothing_is_measured(mirrored2):
    """Under the default policy every group delaying a recurrent layer's bytes stays dense,
    so a single-group recurrent model has nothing to decide: it trains dense from the first
    step, measuring nothing (no decision, no probes, no re-trace), keeps no residuals or
    velocities (nothing to trace, back up or save) and trains exactly as plain Keras."""
    x = np.random.default_rng(0).standard_normal((48, 5, 3)).astype("float32")

    def fit(make_opt, callbacks=()):
        with mirrored2.scope():
            keras.utils.set_random_seed(2)
            model = keras.Sequential([keras.Input((5, 3)), keras.layers.SimpleRNN(40),
                                      keras.layers.Dense(4)])
            opt = make_opt(keras.optimizers.SGD(0.05, momentum=0.9))
            model.compile(opt,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit_in_order(model, x, (x[:, 0, 0] > 0).astype("int32"), 8, 2,
                     callbacks=list(callbacks))
        return opt, [w.numpy() for w in model.weights]

    reads = []

    def counted(inner):
        # the callback reads no metrics (a collective under multi-worker) when there is
        # nothing to decide
        opt = tfbs.BlockSparseOptimizer(inner)
        metrics = opt.block_sparse_metrics
        opt.block_sparse_metrics = lambda *a, **k: reads.append(1) or metrics(*a, **k)
        return opt

    callback = tfbs.AutoExchangeCallback()
    opt, weights = fit(counted, [callback])
    chooser = opt.exchange_chooser
    assert not chooser.has_choice and reads == []
    assert chooser.modes == ["dense"] * len(chooser.groups)
    assert opt.exchange_decision is None and callback.decisions == []
    assert chooser._probe_cache == {} and chooser.measure_s < 0.05
    m = opt.block_sparse_metrics()
    assert m["payload_bytes"] == m["dense_bytes"]
    assert opt.residuals == [] and opt.velocities == []
    _, plain = fit(lambda inner: inner)
    for a, b in zip(weights, plain):
        np.testing.assert_array_equal(a, b)


def test_recurrent_whole_sends_recurrent_layers_whole_and_compresses_the_rest(mirrored2):
    """``recurrent="whole"``: the recurrent layer's variables keep no residual (sent whole
    every step) while the dense layer's kernel is still compressed, and the automatic
    exchange no longer keeps such a model dense for good (nothing delays the recurrent
    bytes)."""
    x = np.random.default_rng(0).standard_normal((32, 5, 3)).astype("float32")

    def build(**kwargs):
        with mirrored2.scope():
            keras.utils.set_random_seed(2)
            model = keras.Sequential([keras.Input((5, 3)), keras.layers.SimpleRNN(40),
                                      keras.layers.Dense(40, name="fc")])
            opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                            dense_below=0, **kwargs)
            model.compile(opt,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, opt

    def fit_velocities(**kwargs):
        model, opt = build(exchange="allgather", recurrent="whole", **kwargs)
        fit_in_order(model, x, (x[:, 0, 0] > 0).astype("int32"), 8, 1)
        norms = {v.path: float(np.abs(r.numpy()).sum())
                 for v, r in zip(model.trainable_variables, opt.residuals)}
        assert [n for p, n in norms.items() if "simple_rnn" in p] == [0.0, 0.0, 0.0]
        assert [n > 0 for p, n in norms.items() if "/fc/" in p] == [True, True], norms
        m = opt.block_sparse_metrics()
        assert m["payload_bytes"] < m["dense_bytes"]
        return {v.path: opt.velocities[i].value.values[0].numpy()
                for i, v in enumerate(model.trainable_variables)}

    # DGC's masking leaves the recurrent layer's momentum alone (sent whole, momentum SGD on
    # it), while the sent block of the compressed kernel leaves its velocity
    vel = fit_velocities(momentum_masking="all")
    assert all(np.all(u != 0) for p, u in vel.items() if "simple_rnn" in p), vel
    fc = vel[next(p for p in vel if "/fc/kernel" in p)]
    assert np.any(np.all(fc == 0, axis=0)) and np.any(fc != 0)
    # the default masking with recurrent="whole" ("none") masks nothing
    vel = fit_velocities()
    assert all(np.all(u != 0) for u in vel.values()), vel
    for recurrent, dense_for_good in (("compress", True), ("whole", False)):
        model, opt = build(recurrent=recurrent)
        with mirrored2.scope():
            opt.build(model.trainable_variables)
        assert opt._schedule.dense_for_good(model.trainable_variables) is dense_for_good


# Heavy (four fits of a recurrent model, ~20 s): `make test-slow` (CI runs it); the fast suite
# keeps recurrent="whole" with both maskings
# (test_recurrent_whole_sends_recurrent_layers_whole_and_compresses_the_rest, above).
@pytest.mark.slow
def test_recurrent_layers_sent_whole_train_as_momentum_sgd(mirrored2):
    """A model of recurrent layers only, ``recurrent="whole"``: every variable is sent whole
    every step with its momentum never masked, so the weights are momentum SGD's (the dense
    exchange's), not plain SGD's, under both sparse exchanges."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 5, 3)).astype("float32")
    y = rng.standard_normal((32, 6)).astype("float32")

    def weights(**kwargs):
        with mirrored2.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((5, 3)), keras.layers.SimpleRNN(6)])
            model.compile(tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                    **kwargs), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    dense = weights(exchange="dense")
    for exchange in ("allgather", "shared"):
        whole = weights(exchange=exchange, recurrent="whole", dense_below=0)
        for a, b in zip(whole, dense):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=exchange)
    plain = weights(exchange="allgather", dense_below=10**9)  # whole, but masked: plain SGD
    assert any(not np.allclose(a, b, rtol=1e-3) for a, b in zip(plain, dense))


def test_a_fixed_sparse_exchange_on_recurrent_layers_warns():
    """Compressing a recurrent layer's gradients is allowed but warned about (it did not
    converge on lstm_nmt); the automatic exchange, dense, local steps and variables sent
    whole do not warn."""
    from tf_blocksparse.checks import RecurrentCompressionWarning

    def build(**kwargs):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(40, name="rnn"),
                                  keras.layers.Dense(4, name="fc")])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), **kwargs)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.build(model.trainable_variables)
        return [w for w in seen if issubclass(w.category, RecurrentCompressionWarning)]

    warned = build(exchange="allgather")
    assert len(warned) == 1 and "recurrent_kernel" in str(warned[0].message)
    assert "exchange='auto'" in str(warned[0].message)
    assert "recurrent='whole'" in str(warned[0].message)
    for kwargs in ({}, {"exchange": "dense"}, {"exchange": "allgather", "sync_every": 4},
                   {"exchange": "shared", "block_rules": {"rnn": "single"}},
                   {"exchange": "allgather", "recurrent": "whole"}):
        assert build(**kwargs) == [], kwargs


def test_measure_exchange_needs_cross_replica_context(mirrored2):
    with mirrored2.scope():
        var = keras.Variable(np.ones((40, 30), "float32"), name="w")
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="auto")
        opt.build([var])  # eagerly in cross-replica context: measured
        assert opt.exchange_decision is not None
        built_s = opt.exchange_chooser.measure_s  # the time measuring took is kept
        assert built_s > 0
        decision = opt.measure_exchange(compute_s=0.01)
    assert decision.compute_s == pytest.approx(0.01)
    assert opt.exchange_chooser.measure_s > built_s

    @tf.function
    def inside():
        mirrored2.run(lambda: opt.measure_exchange())

    with pytest.raises(ValueError, match="cross-replica"):
        inside()
    policy = tfbs.AutoExchange(candidates=("dense", "shared"))
    assert fallback_mode(policy, 4) == "shared" and fallback_mode(policy, 1) == "dense"
    assert fallback_mode(tfbs.AutoExchange(candidates=("dense",)), 4) == "dense"
    with pytest.raises(ValueError, match="modes"):
        opt.exchange_chooser.set_modes(["sparse"])


def test_other_shells_reject_auto():
    with pytest.raises(ValueError, match="exchange"):
        tfbs.BlockSparseCrossDeviceOps(exchange="auto")
    with pytest.raises(ValueError, match="exchange='auto'"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="dense").measure_exchange()


def test_adjacent_groups_of_one_mode_share_their_collectives(mirrored2):
    from tf_blocksparse.planning.exchange_cost import merge_runs

    assert merge_runs([[0], [1, 2], [3], [4]], ["dense", "dense", "shared", "dense"],
                      lambda a, b: a + b) == (
        [[0, 1, 2], [3], [4]], ["dense", "shared", "dense"])
    # all groups allgather: one id buffer with one flag, exactly the plain allgather bytes
    auto = _one_candidate_fit(mirrored2, ("allgather",))
    assert len(auto.modes) >= 2
    plain, _ = _fit_auto(mirrored2, "allgather", dense_below=0)
    assert auto.metrics["payload_bytes"] == plain.block_sparse_metrics()["payload_bytes"]


def test_one_group_out_of_variable_order_is_scattered_back_by_position():
    from tf_blocksparse.keras.optimizer_step import run_grouped_exchange

    grads = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
    ctx = tf.distribute.get_replica_context()
    r = run_grouped_exchange("dense", ctx, lambda g: None, grads, None, [[1, 0]])
    assert [u.shape for u in r.updates] == [(2,), (1, 1)]
    np.testing.assert_array_equal(r.updates[0].numpy(), [1.0, 2.0])


def _momentum_model(strategy, exchange, modes=None, build=False, inner_momentum=0.9,
                    **kwargs):
    """Dense(64, relu) + Dense(4) compiled with SGD(0.05, momentum=inner_momentum) under the
    wrapper; built when ``build`` or ``modes`` (which then forces every group's mode).
    Returns the model and the optimizer."""
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=inner_momentum),
                                        exchange=exchange, **kwargs)
        model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if build or modes is not None:
        with strategy.scope():
            opt.build(model.trainable_variables)
    if modes is not None:
        opt.exchange_chooser.set_modes([modes] * len(opt.exchange_chooser.groups))
    return model, opt


def _momentum_fit(strategy, exchange, epochs, modes=None, remodes=None, inner_momentum=0.9,
                  callbacks=(), **kwargs):
    """:func:`_momentum_model` trained 2 steps per epoch; ``modes`` forces every group's
    mode after the build, ``remodes`` for one more epoch."""
    model, opt = _momentum_model(strategy, exchange, modes, inner_momentum=inner_momentum,
                                 **kwargs)
    y = (X[:, 0] > 0).astype("int32")
    fit_in_order(model, X, y, 16, epochs, callbacks=list(callbacks))
    if remodes is not None:
        opt.exchange_chooser.set_modes([remodes] * len(opt.exchange_chooser.groups))
        model.make_train_function(force=True)
        fit_in_order(model, X, y, 16, 1)
    return model, opt


class _EpochWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


@functools.cache
def _dense_weights(strategy):
    """The reference of the dense comparisons here: ``exchange="dense"``'s weights after each
    of 4 epochs of :func:`_momentum_fit` (trained once per module)."""
    record = _EpochWeights()
    _momentum_fit(strategy, "dense", 4, callbacks=[record])
    return record.weights


def test_all_dense_auto_is_the_dense_exchange_bit_for_bit(mirrored2):
    auto, opt = _momentum_fit(mirrored2, "auto", 3, modes="dense", density=0.1,
                              fusion_buffer_bytes=512)
    assert len(opt.exchange_chooser.groups) >= 2  # merged into one run, in variable order
    for a, b in zip(auto.get_weights(), _dense_weights(mirrored2)[2]):
        np.testing.assert_array_equal(a, b)
    # the momentum is the inner SGD's; the per-replica velocities and residuals are empty
    assert all(np.abs(m.numpy()).sum() > 0 for m in opt.inner_optimizer.momentums)
    assert all(np.abs(u.numpy()).sum() == 0 for u in opt.velocities)
    assert all(np.abs(r.numpy()).sum() == 0 for r in opt.residuals)
    # the serialised inner SGD has no momentum of its own: the policy carries it
    config = opt.get_config()
    assert config["inner"]["config"]["momentum"] == 0.0
    assert config["momentum_correction"]["momentum"] == 0.9
    again = tfbs.BlockSparseOptimizer.from_config(config)
    assert again.inner_optimizer.momentum == 0.9 and again._auto.inner_momentum


@pytest.mark.parametrize("mode", ["allgather", pytest.param("shared", marks=pytest.mark.slow)])
def test_one_sparse_mode_everywhere_is_that_exchange_bit_for_bit(mirrored2, mode):
    fixed, _ = _momentum_fit(mirrored2, mode, 3, density=0.1)
    auto, opt = _momentum_fit(mirrored2, "auto", 3, modes=mode, density=0.1,
                              fusion_buffer_bytes=512)
    assert len(opt.exchange_chooser.groups) >= 2  # merged into one unit, in variable order
    for a, b in zip(auto.get_weights(), fixed.get_weights()):
        np.testing.assert_array_equal(a, b)


def _step_op_types(strategy, exchange, modes=None, **kwargs):
    """The op types of one traced training step of :func:`_momentum_model` (the step's
    graph and the functions it calls), counted; ``modes`` forces every group's mode."""
    model, opt = _momentum_model(strategy, exchange, modes, build=True, **kwargs)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train(x, y):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True)) / strategy.num_replicas_in_sync
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        strategy.run(step, args=(x, y))

    y = (X[:16, 0] > 0).astype("int32")
    graph = train.get_concrete_function(tf.constant(X[:16]), tf.constant(y)).graph
    ops = collections.Counter(op.type for op in graph.get_operations())
    for function in graph.as_graph_def().library.function:
        ops.update(node.op for node in function.node_def)
    return ops


@pytest.mark.parametrize("mode", ["dense", "allgather", "shared"])
def test_a_decided_auto_step_runs_the_fixed_exchanges_ops(mirrored2, mode):
    """Once decided, the automatic exchange adds no op to the step: its per-step cost is the
    chosen exchange's (a step it sends dense is ``exchange="dense"``'s graph)."""
    fixed = _step_op_types(mirrored2, mode, density=0.1, dense_below=0)
    auto = _step_op_types(mirrored2, "auto", modes=mode, density=0.1, dense_below=0,
                          fusion_buffer_bytes=512)
    assert sum(fixed.values()) > 100
    assert ("CollectiveGatherV2" in auto) == (mode == "allgather")
    assert auto == fixed


def test_momentum_moves_with_a_group_between_dense_and_sparse(mirrored2):
    # density 1 with no masking: the sparse exchange sends everything and keeps u, so it is
    # momentum SGD too, and a switch that moved the momentum correctly changes nothing.  (At
    # density 1 "auto" leaves the momentum in the SGD, as for dense: it is given here.)
    kwargs = {"density": 1.0, "momentum_masking": "none", "momentum_correction": 0.9,
              "inner_momentum": 0.0}
    dense = _dense_weights(mirrored2)[3]
    model, opt = _momentum_fit(mirrored2, "auto", 3, modes="dense", **kwargs)
    inner_m = [m.numpy() for m in opt.inner_optimizer.momentums]
    lr = float(tf.convert_to_tensor(opt.inner_optimizer.learning_rate).numpy())
    opt.exchange_chooser.set_modes(["allgather"] * len(opt.exchange_chooser.groups))
    for u, m in zip(opt.velocities, inner_m):  # summed over replicas: the momentum
        np.testing.assert_allclose(u.numpy(), -m / lr, rtol=1e-5, atol=1e-7)
    assert all(np.abs(m.numpy()).sum() == 0 for m in opt.inner_optimizer.momentums)
    model.make_train_function(force=True)
    fit_in_order(model, X, (X[:, 0] > 0).astype("int32"), 16, 1)
    for a, b in zip(model.get_weights(), dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and back: the first dense step sends m u + grad, the velocities empty into the SGD
    back, opt = _momentum_fit(mirrored2, "auto", 3, modes="allgather", remodes="dense",
                              **kwargs)
    assert all(np.abs(u.numpy()).sum() == 0 for u in opt.velocities)
    for a, b in zip(back.get_weights(), dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_switch_to_dense_applies_residuals_once_and_moves_the_momentum(mirrored2):
    # density 0.1 with factor masking: residuals and velocities both hold mass at the switch
    model, opt = _momentum_fit(mirrored2, "auto", 2, modes="allgather", density=0.1,
                               dense_below=0)
    weights = [w.numpy() for w in model.trainable_variables]
    residuals = [r.numpy() for r in opt.residuals]  # summed over the replicas
    velocities = [u.numpy() for u in opt.velocities]
    assert all(np.abs(r).sum() > 0 for r in residuals)
    lr = float(tf.convert_to_tensor(opt.inner_optimizer.learning_rate).numpy())
    opt.exchange_chooser.set_modes(["dense"] * len(opt.exchange_chooser.groups))
    for w, w0, r in zip(model.trainable_variables, weights, residuals):
        np.testing.assert_allclose(w.numpy(), w0 - lr * r, rtol=1e-6, atol=1e-7)
    for m, u in zip(opt.inner_optimizer.momentums, velocities):  # M = -lr v, Keras' form
        np.testing.assert_allclose(m.numpy(), -lr * u, rtol=1e-6, atol=1e-8)
    assert all(np.abs(r.numpy()).sum() == 0 for r in opt.residuals)
    assert all(np.abs(u.numpy()).sum() == 0 for u in opt.velocities)


def test_a_flushed_dense_group_reads_and_writes_no_per_replica_state(mirrored2):
    model, opt = _momentum_fit(mirrored2, "auto", 1, modes="allgather", remodes="dense",
                               density=0.1)

    def mark() -> None:  # a value no step would write: a dense step must leave it alone
        for r in opt.residuals:
            r.value.assign(tf.ones_like(r.value))

    mirrored2.run(mark)
    before = [w.numpy() for w in model.trainable_variables]
    fit_in_order(model, X, (X[:, 0] > 0).astype("int32"), 16, 1)
    assert all(np.all(r.numpy() == 2.0) for r in opt.residuals)  # 2 replicas, untouched
    assert any(not np.array_equal(w.numpy(), b)
               for w, b in zip(model.trainable_variables, before))


def test_an_inner_optimizer_that_needs_the_residual_as_a_gradient_flushes_in_the_step(
        mirrored2):
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.Adam(0.01), exchange="auto")
        clipped = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0),
                                            exchange="auto")
        plain = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="auto")
    assert not opt._auto.flush_at_switch and not clipped._auto.flush_at_switch
    assert plain._auto.flush_at_switch


def test_the_default_is_auto_in_both_forms():
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1)).compression.auto
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=2).compression.auto
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1),
                                     tfbs.CompressionOptions()).compression.auto
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), tfbs.CompressionOptions(
        exchange="allgather")).exchange == "allgather"
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1),
                                     exchange="shared").exchange == "shared"


@pytest.mark.parametrize("own_callback", [False, True])
def test_fit_callbacks_re_decide_once_and_without_them_the_build_decision_stays(
        mirrored2, own_callback):
    """``tfbs.fit_callbacks(model, given)`` adds the automatic exchange's callback to a
    default optimizer's fit (the re-decision after ``warmup_steps`` happens) and does not
    double one the user gave: one re-decision either way.  A fit without it keeps the
    build-time decision and says nothing (nothing is wrong, only not re-measured)."""
    policy = tfbs.AutoExchange(warmup_steps=4, remeasure_steps=0)
    with mirrored2.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), exchange=policy)
        model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        opt.build(model.trainable_variables)
    initial = opt.exchange_decision
    chooser = opt.exchange_chooser
    decide, calls = chooser.decide, []
    chooser.decide = lambda *a, **kw: calls.append((a, kw)) or decide(*a, **kw)
    given = [tfbs.AutoExchangeCallback()] if own_callback else []
    with warnings.catch_warnings():
        warnings.simplefilter("error", tfbs.MissingFitCallbackWarning)
        fit_in_order(model, X, (X[:, 0] > 0).astype("int32"), 8, 1)
    assert calls == [] and opt.exchange_decision is initial
    fit_in_order(model, X, (X[:, 0] > 0).astype("int32"), 8, 2,
                 callbacks=tfbs.fit_callbacks(model, given))  # 4 steps per epoch
    assert len(calls) == 1
    # decided on a measured compute time (the median step's wall time less the exchange's:
    # on a loaded machine that may come out as 0, so only its presence is checked)
    measured = calls[0][0][0] if calls[0][0] else calls[0][1]["compute_s"]
    assert measured is not None and measured >= 0
    assert opt.exchange_decision is not initial
    assert opt.exchange_decision.compute_s == pytest.approx(measured)
    if own_callback:
        assert [step for step, _ in given[0].decisions] == [4]


def test_the_groups_byte_costs_are_computed_once_per_build(mirrored2, monkeypatch):
    """Deciding whether the exchange stays dense for good and the chooser's build-time
    decision read one computation of the groups' byte costs, over one fusion plan."""
    from tf_blocksparse.auto import auto_exchange
    from tf_blocksparse.keras import exchange_schedule
    from tf_blocksparse.keras import optimizer_step as step

    calls, plans = [], []
    for module in (exchange_schedule, auto_exchange):
        real = module.group_cost
        monkeypatch.setattr(module, "group_cost", lambda *a, _real=real, _m=module.__name__,
                            **k: calls.append(_m) or _real(*a, **k))
    real_plan = step.fusion_plan
    monkeypatch.setattr(step, "fusion_plan", lambda *a, **k: plans.append(1) or
                        real_plan(*a, **k))
    with mirrored2.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(64),
                                  keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), density=0.1,
                                        fusion_buffer_bytes=1024)
        opt.build(model.trainable_variables)
    groups = opt.exchange_chooser.groups
    assert len(groups) >= 2 and opt.exchange_decision is not None
    assert calls == [exchange_schedule.__name__] * len(groups)
    assert len(plans) == 1
