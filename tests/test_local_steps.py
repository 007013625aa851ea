"""``sync_every``: local steps with a block-sparse exchange of the replicas' progress.

On 2 real replicas (``MirroredStrategy`` on logical CPUs): with one local step per exchange
and a plain SGD outer step it trains as the per-step exchange; with more, the replicas'
weights differ inside a window and agree after it, following a NumPy reference of DiLoCo's
outer Nesterov step; ``model.fit`` evaluates and saves synchronised weights."""

import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order, in_order
from tests.interrupt import Die

SHAPES = [(6, 8), (8,), (8, 3), (3,)]


def _grads(step: int, replica: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + replica)
    return [rng.standard_normal(s).astype("float32") for s in SHAPES]


def _replica_grads(strategy, step: int):
    """``_grads(step, replica)`` as one distributed value, each replica its own."""
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(tf.constant(g) for g in _grads(step, ctx.replica_id_in_sync_group)))


def _model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                 keras.layers.Dense(3)])


def _run(strategy, opt_fn, steps, watch=None):
    """Applies ``_grads(step, replica)`` for ``steps`` steps; returns the weights, the
    optimizer and, per step in ``watch``, every replica's copy of the weights."""
    model = _model(strategy)
    with strategy.scope():
        opt = opt_fn()
        opt.build(model.trainable_variables)
    variables = model.trainable_variables

    @tf.function
    def step(grads):
        strategy.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    seen = {}
    for s in range(steps):
        step(_replica_grads(strategy, s))
        if watch and s in watch:
            seen[s] = [[c.numpy() for c in strategy.experimental_local_results(v.value)]
                       for v in variables]
    return [v.numpy() for v in variables], opt, seen


@pytest.mark.parametrize("exchange", ["allgather", "shared", "dense"])
def test_one_local_step_with_plain_sgd_outer_is_the_per_step_exchange(mirrored2, exchange):
    def per_step():
        return tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, dense_below=0,
                                         exchange=exchange)

    def local():
        return tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, dense_below=0,
                                         exchange=exchange, sync_every=1,
                                         outer=keras.optimizers.SGD(1.0))

    want, ref, _ = _run(mirrored2, per_step, 5)
    got, opt, _ = _run(mirrored2, local, 5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if exchange != "dense":  # the residuals hold learning-rate-scaled values
        for a, b in zip(opt.residuals, ref.residuals):
            np.testing.assert_allclose(a.numpy(), 0.1 * b.numpy(), rtol=1e-4, atol=1e-6)
    got_bytes, ref_bytes = (o.block_sparse_metrics(mean=True) for o in (opt, ref))
    assert got_bytes["payload_bytes"] == ref_bytes["payload_bytes"] > 0


def _reference(w0, steps, every, lr, outer_lr, outer_momentum, replicas=2):
    """NumPy: inner SGD(lr) per replica on N * g (Keras' loss is divided by N), a dense
    exchange of the mean progress every ``every`` steps, Keras' Nesterov SGD outer step."""
    anchor = [w.astype(np.float64) for w in w0]
    momentum = [np.zeros_like(w) for w in anchor]
    local = [[w.copy() for w in anchor] for _ in range(replicas)]
    for s in range(steps):
        for r in range(replicas):
            local[r] = [w - lr * replicas * g for w, g in zip(local[r], _grads(s, r))]
        if (s + 1) % every == 0:
            delta = [sum(anchor[i] - local[r][i] for r in range(replicas)) / replicas
                     for i in range(len(anchor))]
            for i, d in enumerate(delta):  # Keras SGD, nesterov: m = mu m - lr g
                momentum[i] = outer_momentum * momentum[i] - outer_lr * d
                anchor[i] = anchor[i] + outer_momentum * momentum[i] - outer_lr * d
            local = [[w.copy() for w in anchor] for _ in range(replicas)]
    return anchor


def test_replicas_train_apart_inside_a_window_and_agree_after_it(mirrored2):
    model = _model(mirrored2)
    w0 = [v.numpy() for v in model.trainable_variables]

    def local():
        return tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), exchange="dense",
                                         sync_every=3)

    got, opt, seen = _run(mirrored2, local, 6, watch={0, 2})
    for copies in seen[0]:  # mid-window: each replica its own weights
        assert not np.array_equal(copies[0], copies[1])
    for copies in seen[2]:  # after the exchange: the same weights everywhere
        np.testing.assert_array_equal(copies[0], copies[1])
    want = _reference(w0, 6, 3, 0.05, 0.7, 0.9)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert int(opt.outer_optimizer.iterations.numpy()) == 2
    assert int(opt.iterations.numpy()) == 6
    # bytes per training step: one dense exchange per 3 steps
    figures = opt.block_sparse_metrics(mean=True)
    assert figures["payload_bytes"] == pytest.approx(figures["dense_bytes"] / 3)
    assert figures["syncs"] == 2
    move = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in
                       zip(want, _reference(w0, 3, 3, 0.05, 0.7, 0.9))))
    assert figures["outer_update_norm"] == pytest.approx(move, rel=1e-4)


def test_block_sparse_exchange_keeps_what_it_did_not_send(mirrored2):
    """Conservation: the anchor's move plus what the replicas kept back is the replicas'
    whole progress (a plain SGD(1.0) outer step)."""
    def local():
        return tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), k=1, dense_below=0,
                                         exchange="allgather", sync_every=2,
                                         outer=keras.optimizers.SGD(1.0))

    model = _model(mirrored2)
    w0 = [v.numpy() for v in model.trainable_variables]
    got, opt, _ = _run(mirrored2, local, 2)
    # no outer momentum, one window: anchor = w0 - sum_r sent_r; residual_r = delta_r - sent_r
    kept = [r.numpy() for r in opt.residuals]  # a cross-replica read: the sum
    progress = [np.zeros_like(w) for w in w0]
    for r in range(2):
        local_w = [w.astype(np.float64) for w in w0]
        for s in range(2):
            local_w = [w - 0.05 * 2 * g for w, g in zip(local_w, _grads(s, r))]
        progress = [p + (a - w) / 2 for p, a, w in zip(progress, w0, local_w)]
    for w, start, k, p in zip(got, w0, kept, progress):
        np.testing.assert_allclose(start - w + k, p, rtol=1e-4, atol=1e-6)
        assert np.any(k != 0)


def test_fit_evaluates_and_saves_synchronised_weights(mirrored2, tmp_path):
    """6 steps per epoch with sync_every=4: the epoch's partial window is exchanged after its
    last step, so evaluation and the saved model see one set of weights (in both epochs: the
    second starts from the exchanged weights)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    data = in_order(x, y)[0]
    model = _model(mirrored2)
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                        sync_every=4, density=0.25)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    seen = []

    class Evaluated(keras.callbacks.Callback):  # the weights every evaluation sees
        def on_test_begin(self, logs=None):
            seen.append(_copies(mirrored2, model.trainable_variables))

    history = model.fit(data, steps_per_epoch=6, epochs=2, shuffle=False, validation_data=data,
                        validation_steps=6, verbose=0,
                        callbacks=tfbs.fit_callbacks(model, [Evaluated()]))
    assert len(history.history["val_accuracy"]) == 2 and len(seen) == 2
    for copies in (c for epoch in seen for c in epoch):
        np.testing.assert_array_equal(copies[0], copies[1])
    assert int(opt._state.window.numpy()) == 0
    for v in model.trainable_variables:
        copies = [c.numpy() for c in mirrored2.experimental_local_results(v.value)]
        np.testing.assert_array_equal(copies[0], copies[1])
    # the inner optimizer's momentum stays on each replica
    assert opt.inner_optimizer.momentum == pytest.approx(0.9) and opt.momentum_policy is None
    slots = opt.local_variables[:-len(model.trainable_variables)]
    assert len(slots) == 4 and all("momentum" in v.path for v in slots)
    assert all(
        not np.array_equal(*[c.numpy() for c in mirrored2.experimental_local_results(v.value)])
        for v in slots)
    assert all(a is b for a, b in zip(opt.local_variables[len(slots):],
                                      model.trainable_variables))
    assert opt.get_config()["sync_every"] == 4
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.sync_every == 4
    assert isinstance(loaded.optimizer.outer_optimizer, keras.optimizers.SGD)
    outer = loaded.optimizer.outer_optimizer  # a sparse exchange's default: SGD(1.0)
    assert not outer.nesterov and float(outer.learning_rate) == pytest.approx(1.0)
    for a, b in zip(loaded.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


def test_without_its_callback_fit_warns_and_still_ends_synchronised(mirrored2):
    """Local steps fitted without ``LocalStepsCallback``: one warning naming it, and the end
    of ``fit`` (``finalize_variable_values``) still leaves one set of weights."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((80, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = _model(mirrored2)
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), sync_every=4,
                                        density=0.25)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(tfbs.MissingFitCallbackWarning, match="LocalStepsCallback"):
        fit_in_order(model, x, y, 16)  # 5 steps: a partial window
    assert int(opt._state.window.numpy()) == 0
    for copies in _copies(mirrored2, model.trainable_variables):
        np.testing.assert_array_equal(copies[0], copies[1])


def _local_fit(strategy, epochs, callbacks=()):
    """A model trained with sync_every=3 on 5 steps per epoch (a partial window per epoch,
    exchanged after its last step); the data come in the same order every epoch."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((80, 6)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    model = _model(strategy)
    with strategy.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                        sync_every=3, density=0.25, dense_below=0)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
              callbacks=tfbs.fit_callbacks(model, callbacks))
    return model


def _copies(strategy, variables):
    return [[c.numpy() for c in strategy.experimental_local_results(v.value)]
            for v in variables]


# Three fits with backups (~30 s): `make test-slow`.
@pytest.mark.slow
def test_killed_inside_a_window_and_resumed_trains_as_the_uninterrupted_run(mirrored2,
                                                                            tmp_path,
                                                                            monkeypatch):
    """Backed up after every epoch and killed two steps into a window of epoch 2: the resumed
    run ends with the uninterrupted run's weights, and each replica with its own inner
    momentum, its residuals and the outer optimizer's state, bit for bit.  The epoch-end
    synchronisation is traced without AutoGraph (converting the library costs seconds)."""
    from tf_blocksparse.keras.backup import BackupAndRestore
    from tf_blocksparse.keras.local_steps import LocalSteps

    converted, real = [], LocalSteps.synchronize_replica

    def spy(self, *args, **kwargs):
        converted.extend(f.name for f in traceback.extract_stack() if f.name.startswith("tf__"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LocalSteps, "synchronize_replica", spy)
    whole = _local_fit(mirrored2, 3)
    assert converted == []
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="killed"):
        _local_fit(mirrored2, 3, [BackupAndRestore(backup), Die(7)])
    resumed = _local_fit(mirrored2, 3, [BackupAndRestore(backup)])
    a, b = whole.optimizer, resumed.optimizer
    assert int(b.iterations.numpy()) == int(a.iterations.numpy()) == 15
    for x, y in zip(whole.trainable_variables, resumed.trainable_variables):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    momenta = a.local_variables[:-len(whole.trainable_variables)]
    assert momenta and all(not np.array_equal(*c) for c in _copies(mirrored2, momenta))
    state = [*a.local_variables, *a.residuals, *a.outer_optimizer.variables]
    again = [*b.local_variables, *b.residuals, *b.outer_optimizer.variables]
    for want, got in zip(_copies(mirrored2, state), _copies(mirrored2, again)):
        for x, y in zip(want, got):  # each replica its own copy
            np.testing.assert_array_equal(x, y)


def test_the_automatic_exchange_pinned_to_a_mode_is_that_exchange(mirrored2):
    """``exchange=AutoExchange(candidates=(mode,))`` with local steps trains as ``mode``, bit
    for bit (the automatic exchange's runtime adds nothing to a window)."""
    def make(exchange):
        return lambda: tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), k=1, dense_below=0, exchange=exchange,
            sync_every=3, outer=keras.optimizers.SGD(1.0))

    want, _, _ = _run(mirrored2, make("allgather"), 7)
    got, opt, _ = _run(mirrored2, make(tfbs.AutoExchange(candidates=("allgather",))), 7)
    assert opt.exchange_chooser.modes == ["allgather"]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_the_automatic_exchange_weighs_a_window_and_a_switch_loses_nothing(mirrored2):
    """``exchange="auto"`` with ``sync_every=3``: the build-time prior is a window's compute
    (3 steps), the default outer step is plain SGD(1.0); a group switched from ``allgather``
    to ``dense`` sends its pseudo-gradient plus its residual at the next synchronisation
    (NumPy: every replica's inner SGD moved it by ``lr * sum(g)``), after which no residual
    is left, and the eager synchronisation is re-traced with the new mode."""
    lr = 0.1
    model = _model(mirrored2)
    variables = model.trainable_variables
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(lr), k=1, dense_below=0,
                                        exchange="auto", sync_every=3)
        opt.build(variables)
    assert opt.steps_per_exchange == 3 and opt.exchange_chooser.steps_per_exchange == 3
    decision = opt.exchange_decision
    assert decision.compute_s == pytest.approx(
        3 * opt.exchange.prior_compute_s(decision.groups))
    outer = opt.outer_optimizer
    assert float(outer.learning_rate.numpy()) == 1.0 and outer.momentum == 0.0

    def trace():
        @tf.function
        def step(grads):
            mirrored2.run(lambda g: opt.apply(list(g), variables), args=(grads,))
        return step

    def window(step_fn, first):
        for s in range(first, first + 3):
            step_fn(_replica_grads(mirrored2, s))

    opt.exchange_chooser.set_modes(["allgather"])
    window(trace(), 0)
    weights = [v.numpy() for v in variables]
    residuals = _copies(mirrored2, opt.residuals)
    assert any(np.any(r != 0) for per_var in residuals for r in per_var)
    opt.exchange_chooser.set_modes(["dense"])
    window(trace(), 3)
    for i, w in enumerate(weights):
        sent = sum(lr * sum(_grads(s, r)[i] for s in range(3, 6)) + residuals[i][r]
                   for r in range(2))
        np.testing.assert_allclose(variables[i].numpy(), w - sent, rtol=1e-5, atol=1e-6)
    assert all(np.all(r == 0) for per_var in _copies(mirrored2, opt.residuals)
               for r in per_var)
    one = trace()

    def one_step(s):
        one(_replica_grads(mirrored2, s))

    one_step(6)
    opt.synchronize()  # the eager synchronisation, traced with the dense mode
    assert opt._local._sync_fn is not None
    opt.exchange_chooser.set_modes(["allgather"])
    assert opt._local._sync_fn is None  # dropped with the change
    synced, real = [], opt._local.synchronize_replica
    opt._local.synchronize_replica = lambda *a, **k: (
        synced.append(opt.exchange_chooser.mode_of(0)), real(*a, **k))[1]
    one = trace()
    one_step(7)
    del synced[:]  # the step's own trace of its synchronisation branch
    opt.synchronize()
    assert synced == ["allgather", "allgather"]  # traced again, once per replica


def test_fit_with_the_automatic_exchange_re_decides_and_ends_synchronised(mirrored2):
    """``model.fit`` with ``exchange="auto"`` and ``sync_every=4``: ``fit_callbacks`` adds
    both callbacks, the exchange is re-decided after the warm-up with the measured time of a
    window, and training ends with every replica on the same weights."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = _model(mirrored2)
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), sync_every=4, density=0.25,
            exchange=tfbs.AutoExchange(warmup_steps=6, remeasure_steps=0))
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = tfbs.fit_callbacks(model)
    assert {type(c) for c in callbacks} == {tfbs.AutoExchangeCallback,
                                            tfbs.LocalStepsCallback}
    fit_in_order(model, x, y, 16, 2, callbacks=callbacks)
    auto = next(c for c in callbacks if isinstance(c, tfbs.AutoExchangeCallback))
    assert [s for s, _ in auto.decisions] == [6]
    assert auto.decisions[0][1].compute_s > 0  # a window's measured compute
    assert int(opt._state.window.numpy()) == 0
    for v in model.trainable_variables:
        copies = [c.numpy() for c in mirrored2.experimental_local_results(v.value)]
        np.testing.assert_array_equal(copies[0], copies[1])


def test_the_end_of_a_dense_phase_re_traces_the_synchronisation(mirrored2):
    """``dense_steps`` with local steps: the eager synchronisation traced during the dense
    phase is dropped when the phase ends, so the next one exchanges in the sparse mode."""
    model = _model(mirrored2)
    variables = model.trainable_variables
    with mirrored2.scope():
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, dense_below=0,
                                        exchange="allgather", sync_every=2, dense_steps=2)
        opt.build(variables)

    @tf.function
    def step(grads):
        mirrored2.run(lambda g: opt.apply(list(g), variables), args=(grads,))

    for s in range(3):
        step(_replica_grads(mirrored2, s))
    opt.synchronize()  # traced in the dense phase
    assert opt._local._sync_fn is not None and opt.in_dense_phase
    assert opt.update_dense_phase()
    assert opt._local._sync_fn is None


@pytest.mark.parametrize("kwargs,named", [
    ({"sync_every": 0}, "sync_every"),
    ({"sync_every": True}, "sync_every"),
    ({"outer": "sgd"}, "outer"),
    ({"sync_every": 4, "outer": "sgd"}, "outer"),
    ({"sync_every": 4, "clipping": tfbs.clipping.LocalNormClip(1.0)}, "clipping"),
    ({"sync_every": 4, "gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ({"sync_every": 4, "momentum_correction": 0.9}, "momentum_correction"),
])
def test_bad_local_step_arguments_are_named(kwargs, named):
    inner = keras.optimizers.SGD(0.1)
    with pytest.raises((ValueError, TypeError), match=named):
        tfbs.BlockSparseOptimizer(inner, **kwargs)
    assert inner.momentum == 0.0


def test_default_outer_is_plain_sgd_for_a_sparse_exchange_and_nesterov_for_dense():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), sync_every=8)
    outer = opt.outer_optimizer  # error feedback carries what momentum would
    assert float(outer.learning_rate) == pytest.approx(1.0)
    assert outer.momentum == 0.0 and not outer.nesterov
    assert opt.exchange == "allgather" and opt.momentum_policy is None
    dense = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), sync_every=8,
                                      exchange="dense").outer_optimizer  # DiLoCo's
    assert float(dense.learning_rate) == pytest.approx(0.7)
    assert dense.momentum == pytest.approx(0.9) and dense.nesterov
