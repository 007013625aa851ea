"""DensityWarmup: per-epoch densities in model.fit on 2 real replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests import reference as ref
from tests.batches import fit_in_order
from tests.test_optimizer import _fit, _xy, plain_sgd_weights
from tests.test_optimizer_reference import LR, MOMENTUM, STEPS, _data, _loss, _model, _replica_grads


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_density_one_epoch_trains_like_plain_sgd(mirrored2, mode):
    """Epoch 0 at density 1.0 sends everything: the weights match plain SGD(momentum)."""
    ours, opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), k=1, exchange=mode, dense_below=0,
        momentum_correction=None), callbacks=[tfbs.DensityWarmup([1.0])])
    # plain SGD(0.1, momentum=0.9) for one epoch of the same batches (trained once)
    for a, b in zip(plain_sgd_weights(mirrored2), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for r in opt.residuals:  # nothing was held back
        assert not np.any(r.value.values[0].numpy())
    assert (opt.k, opt.density) == (1, None)  # the optimizer's own setting is back


def test_densities_switch_per_epoch_and_residuals_carry_over(mirrored2):
    opt_fn = lambda: tfbs.BlockSparseOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.05), k=1, momentum_correction=0.9, dense_below=0,
        exchange="allgather")
    warm = tfbs.DensityWarmup([1.0, 0.5])
    model, opt, hist = _fit(mirrored2, opt_fn, 4, callbacks=[tfbs.BlockSparseMetrics(), warm])
    sent = hist.history["payload_bytes"]
    assert sent[0] > sent[1] > sent[2] == sent[3], sent
    assert hist.history["dense_bytes"][0] == hist.history["dense_bytes"][3]
    assert (warm.density_at(0), warm.density_at(1), warm.density_at(5)) == (
        (None, 1.0), (None, 0.5), (1, None))
    assert (opt.k, opt.density) == (1, None)
    assert any(np.any(r.value.values[0].numpy()) for r in opt.residuals)
    assert np.isfinite(hist.history["loss"]).all()
    # a second fit with the same callback starts again from the warm-up (epoch 0 at 1.0)
    hist2 = fit_in_order(model, *_xy(), 16, 1, callbacks=[tfbs.BlockSparseMetrics(), warm])
    assert hist2.history["payload_bytes"][0] == sent[0]


@pytest.mark.parametrize("bad", [[], [0.0], [1.5], [0.5, -0.1], "0.5", [True], 0.5,
                                 [float("nan")]])
def test_bad_densities_are_named(bad):
    with pytest.raises(ValueError, match="densities"):
        tfbs.DensityWarmup(bad)


@pytest.mark.parametrize("make_opt,match", [
    (lambda: keras.optimizers.SGD(0.1), "BlockSparseOptimizer"),
    (lambda: tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="dense"),
     "sparse exchange")])
def test_needs_a_sparse_block_sparse_optimizer(mirrored2, make_opt, match):
    with pytest.raises(ValueError, match=match):
        _fit(mirrored2, make_opt, callbacks=[tfbs.DensityWarmup([0.5])])


def test_switching_density_between_traces_matches_numpy_reference(mirrored2):
    """What the callback does (new density, new trace) against the NumPy reference: steps
    0-1 keep 50% of the blocks, steps 2-3 one block; the residuals carry across."""
    schedule = [(None, 0.5)] * (STEPS // 2) + [(1, None)] * (STEPS - STEPS // 2)
    with mirrored2.scope():
        model = _model()
        # the reference: every variable compressed, global momentum in the inner SGD
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), k=1,
                                        dense_below=0, momentum_correction=None,
                                        exchange="allgather")
        opt.build(model.trainable_variables)

    def make_train():
        @tf.function
        def train(x, y):
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = _loss(model, xb, yb, 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            mirrored2.run(step, args=(x, y))
        return train

    train, current = None, None
    for s, setting in enumerate(schedule):
        if setting != current:
            opt.k, opt.density = current = setting
            train = make_train()
        x, y = (mirrored2.experimental_distribute_values_from_function(
            lambda ctx, s=s, j=j: tf.constant(_data(s, ctx.replica_id_in_sync_group)[j]))
            for j in (0, 1))
        train(x, y)

    ref_model = _model()
    layouts = tfbs.blocks.layouts_for(ref_model.trainable_variables, ref_model)
    weights = [w.numpy() for w in ref_model.trainable_variables]
    moms = [np.zeros_like(w) for w in weights]
    residuals = [[np.zeros_like(w) for w in weights] for _ in range(2)]
    for s, (k, density) in enumerate(schedule):
        grads = [_replica_grads(weights, *_data(s, r), 2) for r in range(2)]
        updates, residuals, _ = ref.np_step("allgather", grads, residuals, layouts, k, density,
                                            "l1")
        for i, g in enumerate(updates):
            weights[i], moms[i] = ref.np_sgd_momentum(weights[i], moms[i], g, LR, MOMENTUM)
    for got, want in zip(model.trainable_variables, weights):
        np.testing.assert_allclose(got.value.values[1].numpy(), want, rtol=2e-5, atol=2e-6)
    for var, want in zip(opt.residuals, residuals[1]):
        np.testing.assert_allclose(var.value.values[1].numpy(), want, rtol=2e-5, atol=2e-6)
