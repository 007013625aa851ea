"""The wrapper against a NumPy re-implementation of the method, on 2 real replicas."""

import collections
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests import reference as ref

LR, MOMENTUM, STEPS = 0.05, 0.9, 4


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3),
    ])


def _data(step: int, replica: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + replica)
    return (rng.standard_normal((4, 6, 6, 2)).astype("float32"),
            rng.standard_normal((4, 3)).astype("float32"))


def _loss(model, x, y, num_replicas):
    return tf.reduce_mean(tf.square(model(x) - y)) / num_replicas


@functools.cache
def _grad_model() -> keras.Model:
    """The one-device model the references compute gradients with; every use sets all its
    weights first, and nothing trains it."""
    return _model()


def _replica_grads(weights, x, y, num_replicas, grad_model=None):
    """Per-replica gradients computed on one device at the given weights (on
    ``grad_model``, default :func:`_grad_model`; sparse gradients made dense)."""
    m = grad_model or _grad_model()
    m.set_weights(weights)
    with tf.GradientTape() as tape:
        loss = _loss(m, x, y, num_replicas)
    return [tf.convert_to_tensor(g).numpy()
            for g in tape.gradient(loss, m.trainable_variables)]


def _run_distributed(strategy, inner_momentum=MOMENTUM, model_fn=_model, data_fn=_data,
                     **opt_kwargs):
    """``model_fn()`` trained STEPS steps on ``data_fn(step, replica)`` over ``strategy``
    by ``BlockSparseOptimizer(SGD(LR, inner_momentum), **opt_kwargs)``."""
    with strategy.scope():
        model = model_fn()
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(LR, momentum=inner_momentum),
                                        **opt_kwargs)
        opt.build(model.trainable_variables)
    n = strategy.num_replicas_in_sync

    @tf.function
    def train(x, y):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _loss(model, xb, yb, n)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(step, args=(x, y))

    for s in range(STEPS):
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: tf.constant(data_fn(s, ctx.replica_id_in_sync_group)[0]))
        y = strategy.experimental_distribute_values_from_function(
            lambda ctx, s=s: tf.constant(data_fn(s, ctx.replica_id_in_sync_group)[1]))
        train(x, y)
    return model, opt


def _run_reference(n, mode, k=None, density=None, metric="l1", dense_below=0):
    """Weights and ``[replica][variable]`` residuals after STEPS steps of the NumPy
    reference (computed once per module and argument set; the arrays are read-only)."""
    return _reference_once(n, mode, k, density, metric, dense_below)


@functools.cache
def _start() -> tuple[tuple, tuple[np.ndarray, ...]]:
    """The layouts and initial weights (read-only) of :func:`_model`, for the references."""
    model = _model()
    return (tuple(tfbs.blocks.layouts_for(model.trainable_variables, model)),
            _read_only(w.numpy() for w in model.trainable_variables))


@functools.cache
def _reference_once(n, mode, k, density, metric, dense_below):
    layouts, start = _start()
    weights = list(start)
    moms = [np.zeros_like(w) for w in weights]
    residuals = [[np.zeros_like(w) for w in weights] for _ in range(n)]
    for s in range(STEPS):
        grads = [_replica_grads(weights, *_data(s, r), n) for r in range(n)]
        updates, residuals, finite = ref.np_step(mode, grads, residuals, layouts, k, density,
                                                 metric, dense_below=dense_below)
        assert finite
        for i, g in enumerate(updates):
            weights[i], moms[i] = ref.np_sgd_momentum(weights[i], moms[i], g, LR, MOMENTUM)
    return _read_only(weights), [_read_only(rs) for rs in residuals]


def _read_only(arrays):
    """``arrays`` as a tuple of read-only copies, safe to share between tests."""
    out = tuple(np.array(a) for a in arrays)
    for a in out:
        a.flags.writeable = False
    return out


@pytest.mark.parametrize("mode", ["allgather", "shared", "dense"])
@pytest.mark.parametrize("metric", ["l1", "l2"])
def test_matches_numpy_reference(mirrored2, mode, metric):
    kwargs = {"density": 0.5} if metric == "l2" else {"k": 1}
    # the reference: every variable compressed, global momentum in the inner SGD
    model, opt = _run_distributed(mirrored2, exchange=mode, metric=metric, dense_below=0,
                                  momentum_correction=None, **kwargs)
    want_w, want_r = _run_reference(2, mode, metric=metric, **kwargs)
    for got, want in zip(model.trainable_variables, want_w):
        for replica_value in got.value.values:
            np.testing.assert_allclose(replica_value.numpy(), want, rtol=2e-5, atol=2e-6)
    if mode != "dense":
        for r, var in enumerate(opt.residuals):
            for replica in range(2):
                np.testing.assert_allclose(var.value.values[replica].numpy(), want_r[replica][r],
                                           rtol=2e-5, atol=2e-6)
    assert int(opt.iterations.numpy()) == STEPS


@pytest.mark.parametrize("mode", ["allgather", "shared", "dense"])
def test_fusion_groups_do_not_change_the_result(mirrored2, mode):
    """Per-group packing is the same math: weights match the single-buffer reference."""
    model, opt = _run_distributed(mirrored2, exchange=mode, k=1, fusion_buffer_bytes=600,
                                  dense_below=0, momentum_correction=None)
    want_w, want_r = _run_reference(2, mode, k=1)
    for got, want in zip(model.trainable_variables, want_w):
        np.testing.assert_allclose(got.value.values[0].numpy(), want, rtol=2e-5, atol=2e-6)
    if mode != "dense":
        for r, var in enumerate(opt.residuals):
            np.testing.assert_allclose(var.value.values[1].numpy(), want_r[1][r], rtol=2e-5,
                                       atol=2e-6)
    assert opt.block_sparse_metrics()["dense_bytes"] == 4 * sum(
        int(np.prod(v.shape)) for v in model.trainable_variables)


def _collectives(strategy, **opt_kwargs) -> tuple[collections.Counter, keras.Model]:
    """Collective op types in one traced training step, and the model."""
    with strategy.scope():
        model = _model()
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(LR), **opt_kwargs)
        opt.build(model.trainable_variables)

    @tf.function
    def train(x, y):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _loss(model, xb, yb, 2)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
        strategy.run(step, args=(x, y))

    x, y = _data(0, 0)
    graph = train.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    return collections.Counter(op.type for op in graph.get_operations()
                               if op.type.startswith("Collective")), model


def test_each_fusion_group_has_its_own_collectives(mirrored2):
    from tf_blocksparse.planning import TensorSpec, execution_order, plan_balanced

    ops, model = _collectives(mirrored2, k=1, fusion_buffer_bytes=600, dense_below=0,
                              exchange="allgather")
    specs = [TensorSpec(v.path, 4 * int(np.prod(v.shape))) for v in model.trainable_variables]
    groups = plan_balanced(specs, 600, execution_order(len(specs))).groups
    assert len(groups) > 1
    # 2 replicas x (ids, values) per group
    assert ops == {"CollectiveGatherV2": 2 * 2 * len(groups)}


@pytest.mark.parametrize("mode,dense_below,want", [
    ("allgather", 0, {"CollectiveGatherV2": 2}),
    ("allgather", 100, {"CollectiveGatherV2": 2, "CollectiveReduceV2": 1}),
    ("allgather", 10**6, {"CollectiveReduceV2": 1}),
    ("shared", 0, {"CollectiveReduceV2": 2}),
    ("shared", 100, {"CollectiveReduceV2": 3}),
    ("shared", 10**6, {"CollectiveReduceV2": 1}),
])
def test_whole_variables_take_one_dense_all_reduce(mirrored2, mode, dense_below, want):
    """Per replica: the sparse buffers as without ``dense_below`` (if any variable is still
    compressed), plus one all-reduce of the variables sent whole (if any)."""
    ops, _ = _collectives(mirrored2, k=1, exchange=mode, dense_below=dense_below)
    assert ops == {name: 2 * n for name, n in want.items()}


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_dense_below_sends_small_variables_whole(mirrored2, mode):
    """dense_below=100: the 72-element conv kernel and every bias go whole (no residual),
    the 320-element Dense kernel keeps one block; weights match the NumPy reference."""
    model, opt = _run_distributed(mirrored2, exchange=mode, k=1, dense_below=100,
                                  momentum_correction=None)
    want_w, want_r = _run_reference(2, mode, k=1, dense_below=100)
    for got, want in zip(model.trainable_variables, want_w):
        np.testing.assert_allclose(got.value.values[0].numpy(), want, rtol=2e-5, atol=2e-6)
    for var, residual, want in zip(model.trainable_variables, opt.residuals, want_r[1]):
        got = residual.value.values[1].numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        assert np.any(got) == (int(np.prod(var.shape)) >= 100), var.path
    assert opt.get_config()["compression"]["dense_below"] == 100
    # only the Dense kernel (5 blocks of 64) carries ids (1 + flag) or scores (5); the
    # 99 elements of the others go as one dense sum.
    side = 4 * 2 if mode == "allgather" else 4 * 5
    want_bytes = side + 4 * 64 + 4 * (72 + 4 + 5 + 15 + 3)
    assert opt.block_sparse_metrics()["payload_bytes"] == want_bytes == ref.np_payload_bytes(
        mode, opt.layouts, k=1, dense_below=100)


@functools.cache
def _dense_values(strategy):
    """Replica 0's weights after ``exchange="dense"`` with global momentum in the inner SGD
    (trained once per module)."""
    model, _ = _run_distributed(strategy, exchange="dense", momentum_correction=None)
    return [v.value.values[0].numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_dense_below_above_every_size_equals_dense_exchange(mirrored2, mode):
    # both with global momentum in the inner SGD
    model, opt = _run_distributed(mirrored2, exchange=mode, k=1, dense_below=10**6,
                                  momentum_correction=None)
    for a, b in zip(model.trainable_variables, _dense_values(mirrored2)):
        np.testing.assert_allclose(a.value.values[0].numpy(), b, rtol=1e-6, atol=1e-7)
    m = opt.block_sparse_metrics()
    assert m["payload_bytes"] == m["dense_bytes"]  # no ids, scores or flag


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_dense_below_is_named(bad):
    with pytest.raises(ValueError, match="dense_below"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), dense_below=bad, exchange="allgather")
    with pytest.raises(ValueError, match="dense_below"):
        tfbs.BlockSparseCrossDeviceOps(dense_below=bad)
    with pytest.raises(ValueError, match="dense_below"):
        tfbs.BlockTopK([], dense_below=bad)
