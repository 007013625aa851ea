"""BlockSparseCrossDeviceOps under MirroredStrategy: parity with the optimizer wrapper."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order

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
    hist = fit_in_order(model, *_data(), 16, 2)
    return model, hist


@functools.cache
def _default_reduction_weights(strategy) -> list:
    """The weights of :func:`_fit` under Keras' SGD(0.05, momentum=0.9) through ``strategy``'s
    default (collective) reduction (trained once per process, read only)."""
    return _fit(strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9))[0].get_weights()


@functools.cache
def _ops_fit(exchange: str, dense_below: int):
    """The model, history and ops of one :func:`_fit` through ``BlockSparseCrossDeviceOps``
    with k=1 under Keras' SGD(0.05, momentum=0.9) (its strategy runs nothing else)."""
    strategy, ops = _strategy("ops", k=1, exchange=exchange, dense_below=dense_below)
    model, hist = _fit(strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9), ops)
    return model, hist, ops


# Two settings in the default suite (both modes, with and without variables sent whole);
# the mixed ones are heavy and run with `make test-slow`.
@pytest.mark.parametrize("exchange,dense_below", [
    ("allgather", 0), pytest.param("shared", 0, marks=pytest.mark.slow),
    pytest.param("allgather", 100, marks=pytest.mark.slow), ("shared", 100)])
def test_same_weights_as_the_optimizer_wrapper(mirrored2, exchange, dense_below):
    via_ops, hist, ops = _ops_fit(exchange, dense_below)
    # the ops side's Keras SGD applies global momentum after the exchange: so must the wrapper
    via_opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), k=1, exchange=exchange,
        dense_below=dense_below, momentum_correction=None))
    for a, b in zip(via_ops.get_weights(), via_opt.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(via_ops.get_weights()[0], _model().get_weights()[0])
    # metrics (accuracy) and losses still reduce densely
    assert 0.0 <= hist.history["accuracy"][-1] <= 1.0
    assert ops.payload_bytes < ops.dense_bytes / 2
    residuals = next(iter(ops.residuals.values()))
    assert len(residuals) == 2 and len(residuals[0]) == 4
    assert not np.array_equal(residuals[0][2].numpy(), residuals[1][2].numpy())
    # the 45-element conv kernel goes whole under dense_below=100: nothing held back, and
    # it and both biases (5, 3) send no ids; the Dense kernel keeps 1 of 3 blocks of 180
    assert np.any(residuals[0][0].numpy()) == (dense_below == 0)
    ids = 4 * (1 if dense_below else 4)
    values = 4 * (180 + 45 + 5 + 3) if dense_below else 4 * (9 + 1 + 180 + 1)
    assert ops.payload_bytes == ids + values


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


@pytest.mark.parametrize("buffer_bytes", [64, pytest.param(2000, marks=pytest.mark.slow),
                                          10**6])
def test_fused_ops_bit_identical_to_default_reduction(mirrored2, buffer_bytes):
    key = ("fused", buffer_bytes)
    if key not in _STRATEGIES:
        ops = tfbs.BlockSparseCrossDeviceOps(fusion=buffer_bytes)
        _STRATEGIES[key] = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                           cross_device_ops=ops), ops)
    fused, ops = _STRATEGIES[key]
    a, _ = _fit(fused, lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    # mirrored2: the default reduction (one such strategy per process), the same for every size
    for x, y in zip(a.get_weights(), _default_reduction_weights(mirrored2)):
        assert np.array_equal(x, y)
    # backward order: dense bias 12 B, dense kernel 2160 B, conv bias 20 B, conv kernel 180 B;
    # 64 B: 12+2160 (bias rides along with the oversized kernel) | 20+180 (also oversized);
    # 2000 B: 12+2160 | 20+180; 1 MB: one buffer
    assert ops.collectives_per_step == {64: 2, 2000: 2, 10**6: 1}[buffer_bytes]


def test_fused_ops_arguments():
    with pytest.raises(ValueError, match="`fusion`"):
        tfbs.BlockSparseCrossDeviceOps(fusion=0)
    with pytest.raises(ValueError, match="`fusion`"):
        tfbs.BlockSparseCrossDeviceOps(fusion="1MB")
    dense = tfbs.BlockSparseCrossDeviceOps(fusion=100)
    assert dense.options is None and dense.k is None and dense.buffer_bytes == 100


def test_fused_cross_device_ops_is_a_deprecated_name_of_the_one_class():
    with pytest.warns(DeprecationWarning, match="BlockSparseCrossDeviceOps"):
        ops = tfbs.FusedCrossDeviceOps(buffer_bytes=64)
    assert type(ops) is tfbs.BlockSparseCrossDeviceOps and ops.options is None
    assert ops.buffer_bytes == 64 and ops.plan is None
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="exactly one"):
        tfbs.FusedCrossDeviceOps()
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="`buffer_bytes`"):
        tfbs.FusedCrossDeviceOps(buffer_bytes=0)


def _reduce_batch(strategy, grads_per_replica):
    """SUM ``batch_reduce`` of per-replica gradient lists (``[replica][gradient]``)."""
    def value_fn(ctx, i):
        return tf.constant(grads_per_replica[ctx.replica_id_in_sync_group][i])

    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, i=i: value_fn(ctx, i)) for i in range(len(grads_per_replica[0]))]
    return strategy.extended.batch_reduce_to("SUM", [(v, v) for v in values])


def test_residuals_checkpoint_round_trip_and_restore_before_first_step(tmp_path):
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal((3, 4)).astype("float32"),
              rng.standard_normal(4).astype("float32")] for _ in range(2)]
    strategy, ops = _strategy("ops", k=1, metric="l2", dense_below=0)
    out = _reduce_batch(strategy, grads)
    saved = [[r.numpy() for r in dev] for dev in next(iter(ops.residuals.values()))]
    assert any(np.abs(r).sum() > 0 for dev in saved for r in dev)
    path = tf.train.Checkpoint(residuals=ops.state).write(str(tmp_path / "ckpt"))
    # a fresh ops object restores before its residuals exist; they take the values on creation
    strategy2, ops2 = _strategy("ops", k=1, metric="l2", exchange="allgather", dense_below=0)
    assert ops2 is not ops and not ops2.residuals
    tf.train.Checkpoint(residuals=ops2.state).read(path).assert_existing_objects_matched()
    zeros = [[np.zeros_like(g) for g in rep] for rep in grads]
    out2 = _reduce_batch(strategy2, zeros)  # acc = residual: the restored residual is sent on
    restored = next(iter(ops2.residuals.values()))
    sent = [strategy2.experimental_local_results(o)[0].numpy() for o in out2]
    first = [strategy.experimental_local_results(o)[0].numpy() for o in out]
    total_in = [sum(rep[i] for rep in grads) for i in range(2)]
    for i in range(2):  # conservation across the two steps: sent + kept == all gradients
        kept = sum(restored[d][i].numpy() for d in range(2))
        np.testing.assert_allclose(first[i] + sent[i] + kept, total_in[i], rtol=1e-6, atol=1e-6)
    assert any(np.abs(s).sum() > 0 for s in sent)


def test_nonfinite_gradients_leave_residuals_and_reach_the_optimizer():
    strategy, ops = _strategy("ops", k=1, metric="l1", exchange="shared", dense_below=0)
    rng = np.random.default_rng(1)
    grads = [[rng.standard_normal((3, 4)).astype("float32"),
              rng.standard_normal(4).astype("float32")] for _ in range(2)]
    _reduce_batch(strategy, grads)
    before = [[r.numpy() for r in dev] for dev in next(iter(ops.residuals.values()))]
    bad = [[g.copy() for g in rep] for rep in grads]
    bad[1][0][0, 0] = np.nan
    out = _reduce_batch(strategy, bad)
    after = [[r.numpy() for r in dev] for dev in next(iter(ops.residuals.values()))]
    for b, a in zip(before, after):
        for x, y in zip(b, a):
            np.testing.assert_array_equal(x, y)
    summed = strategy.experimental_local_results(out[0])[0].numpy()
    assert np.isnan(summed[0, 0]) and np.isfinite(summed[1:]).all()
    np.testing.assert_allclose(strategy.experimental_local_results(out[1])[0].numpy(),
                               bad[0][1] + bad[1][1], rtol=1e-6)


@pytest.mark.parametrize("exchange,dense_below", [
    ("allgather", 0), pytest.param("shared", 100, marks=pytest.mark.slow)])
def test_fusion_and_compression_together_match_the_optimizer_wrapper(mirrored2, exchange,
                                                                      dense_below):
    """Fusion buckets and block sparsity composed under one MirroredStrategy.

    Every compressor selects per variable (its own ``k`` of its own blocks, from its own
    scores), so cutting the batch into buckets changes which collectives carry a variable,
    not what is sent: the weights are those of the unbucketed ops bit for bit, and those of
    the optimizer wrapper with the same options (and fusion buffer) as closely as the
    existing parity test (its replica-context sums are TF's collectives, not the ops' sums).
    """
    compression = tfbs.CompressionOptions(k=1, exchange=exchange, dense_below=dense_below)
    fused, fused_ops = _strategy("ops", compression=compression, fusion=64)
    via_fused, _ = _fit(fused, lambda: keras.optimizers.SGD(0.05, momentum=0.9), fused_ops)
    via_plain, _, plain_ops = _ops_fit(exchange, dense_below)  # the same options, unfused
    via_opt, _ = _fit(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compression, momentum_correction=None,
        fusion_buffer_bytes=64))
    # backward order: dense bias 12 B + kernel 2160 B | conv bias 20 B + kernel 180 B
    assert fused_ops.collectives_per_step == 2 and plain_ops.collectives_per_step == 1
    assert [g.members for g in fused_ops.last_plan.groups] == [(3, 2), (1, 0)]
    for a, b, c in zip(via_fused.get_weights(), via_plain.get_weights(),
                       via_opt.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)
    assert not np.allclose(via_fused.get_weights()[0], _model().get_weights()[0])
    assert fused_ops.payload_bytes == plain_ops.payload_bytes < fused_ops.dense_bytes / 2
    for r_fused, r_plain in zip(next(iter(fused_ops.residuals.values())),
                                next(iter(plain_ops.residuals.values()))):
        for x, y in zip(r_fused, r_plain):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
