"""Layer-wise local gradient clipping: NumPy references, per-replica semantics,
state checkpoints and the graph structure that lets the exchange overlap backward."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tf_blocksparse as tfbs
from tests.reference_clipping import (
    np_agc,
    np_local_norm_clip,
    np_momentum_clip_sequence,
    np_value_clip,
    np_variance_clip_sequence,
)
from tf_blocksparse import clipping_baseline

clip = tfbs.clipping
FAST = settings(max_examples=40, deadline=None)
floats = st.floats(-100, 100, width=32, allow_nan=False, allow_subnormal=False)


@FAST
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=floats),
       st.floats(-5, 0, width=32, allow_subnormal=False),
       st.floats(0, 5, width=32, allow_subnormal=False))
def test_value_clip_matches_numpy(g, lower, upper):
    np.testing.assert_array_equal(clip.value_clip(g, lower, upper).numpy(),
                                  np_value_clip(g, np.float32(lower), np.float32(upper)))


@FAST
@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=floats),
       st.floats(0.01, 50), st.integers(1, 16))
def test_local_norm_clip_matches_numpy(g, threshold, workers):
    got = clip.local_norm_clip(g, threshold, workers).numpy()
    np.testing.assert_allclose(got, np_local_norm_clip(g, threshold, workers),
                               rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(got) <= threshold / np.sqrt(workers) * (1 + 1e-5)


@pytest.mark.parametrize("shape", [(), (7,), (6, 5), (4, 3, 5), (3, 3, 4, 6), (2, 3, 3, 2, 4)],
                         ids=["scalar", "bias", "dense", "conv1d", "conv2d", "conv3d"])
@pytest.mark.parametrize("clip_factor, eps", [(0.01, 1e-3), (0.5, 1e-3), (0.1, 0.5)])
def test_adaptive_clip_matches_nfnets_formula(shape, clip_factor, eps):
    rng = np.random.default_rng(len(shape))
    g = (rng.standard_normal(shape) * rng.choice([0.01, 1.0, 30.0], size=shape)).astype("float32")
    w = rng.standard_normal(shape).astype("float32")
    if len(shape) >= 2:
        w[..., 0] = 0.0  # a unit at the eps floor
    got = clip.adaptive_clip(g, w, clip_factor, eps).numpy()
    np.testing.assert_allclose(got, np_agc(g, w, clip_factor, eps), rtol=1e-5, atol=1e-7)
    assert got.shape == g.shape


def test_unitwise_norm_axes():
    assert clip.unitwise_norm(tf.ones((3, 3, 4, 6))).shape == (1, 1, 1, 6)
    assert clip.unitwise_norm(tf.ones((3, 4, 6))).shape == (1, 1, 6)  # Conv1D: per filter
    assert clip.unitwise_norm(tf.ones((6, 5))).shape == (1, 5)
    assert clip.unitwise_norm(tf.ones((7,))).shape == (1,)
    np.testing.assert_allclose(clip.unitwise_norm(tf.ones((3, 3, 4, 6))).numpy(), 6.0)
    np.testing.assert_allclose(clip.unitwise_norm(tf.ones((3, 4, 6))).numpy(), np.sqrt(12.0))
    assert clip.unitwise_norm(tf.ones((3, 3, 5, 4)), unit_axes=(-2,)).shape == (1, 1, 5, 1)
    assert clip.unitwise_norm(tf.ones((4, 3, 5)), unit_axes=(1, 2)).shape == (1, 3, 5)
    assert clip.unitwise_norm(tf.ones((4, 3)), unit_axes=()).shape == (1, 1)


def test_conv1d_kernel_is_clipped_per_output_filter():
    # Conv1D kernel (kw, cin, cout): only filter 0's gradient is large, so only filter 0 is
    # scaled (per-(cin, cout) units would also leave part of filter 0 alone).
    kernel = keras.layers.Conv1D(3, 2)
    kernel.build((None, 5, 4))
    w = kernel.kernel.numpy()
    g = np.full(w.shape, 1e-4, "float32")
    g[:, 0, 0] = 50.0  # one input channel of filter 0 only
    got = clip.adaptive_clip(g, w, 0.01).numpy()
    np.testing.assert_allclose(got, np_agc(g, w, 0.01), rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(got[..., 1:], g[..., 1:])
    scale = got[..., 0] / g[..., 0]
    np.testing.assert_allclose(scale, scale[0, 0], rtol=1e-5)  # one factor for the filter
    assert scale[0, 0] < 1e-2


@pytest.mark.parametrize("shape, unit_axes", [((3, 3, 5, 4), (2,)), ((3, 3, 5, 4), (-2,)),
                                               ((4, 3, 5), (1, 2)), ((6, 5), (0,)),
                                               ((6, 5), ())])
def test_adaptive_clip_explicit_unit_axes_match_numpy(shape, unit_axes):
    rng = np.random.default_rng(7)
    g = (rng.standard_normal(shape) * rng.choice([0.01, 30.0], size=shape)).astype("float32")
    w = rng.standard_normal(shape).astype("float32")
    got = clip.adaptive_clip(g, w, 0.05, unit_axes=unit_axes).numpy()
    np.testing.assert_allclose(got, np_agc(g, w, 0.05, unit_axes=unit_axes),
                               rtol=1e-5, atol=1e-7)


def _run_rule(rule, grads):
    state = rule.init(grads[0].shape)
    out = []
    for g in grads:
        g, state = rule.clip(tf.constant(g), tf.zeros_like(g), state, 1)
        out.append(g.numpy())
    return out, state.numpy()


def _spiky(n=30, seed=0):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal((4, 3)).astype("float32") * (1 + 0.1 * i) for i in range(n)]
    grads[20] = grads[20] * 50  # a spike after the warm-up
    return grads


@pytest.mark.parametrize("c, decay, warmup", [(3.0, 0.99, 10), (1.0, 0.9, 3)])
def test_variance_clip_matches_numpy_and_cuts_the_spike(c, decay, warmup):
    grads = _spiky()
    got, state = _run_rule(clip.VarianceClip(c, decay, warmup), grads)
    want, (mean, var, count) = np_variance_clip_sequence(grads, c, decay, warmup)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state, [mean, var, count], rtol=1e-4)
    assert np.linalg.norm(got[20]) < np.linalg.norm(grads[20]) / 5
    np.testing.assert_array_equal(got[0], grads[0])  # nothing clipped during the warm-up


@pytest.mark.parametrize("factor, decay, warmup", [(2.0, 0.9, 10), (1.5, 0.5, 2)])
def test_momentum_clip_matches_numpy_and_cuts_the_spike(factor, decay, warmup):
    grads = _spiky(seed=1)
    got, state = _run_rule(clip.MomentumClip(factor, decay, warmup), grads)
    want, (avg, count) = np_momentum_clip_sequence(grads, factor, decay, warmup)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state, [avg, count], rtol=1e-4)
    assert np.linalg.norm(got[20]) < np.linalg.norm(grads[20]) / 5


def test_rules_compose_in_order():
    g = np.array([[3.0, -4.0], [0.5, 0.1]], "float32")
    rules = [clip.ValueClip(-1.0, 1.0), clip.LocalNormClip(1.0)]
    out, _ = clip.apply_rules(rules, [tf.constant(g)], [tf.zeros_like(g)], [[]], 4)
    np.testing.assert_allclose(out[0].numpy(),
                               np_local_norm_clip(np_value_clip(g, -1, 1), 1.0, 4), rtol=1e-6)


@pytest.mark.parametrize("make, name", [
    (lambda: clip.value_clip(tf.ones(2), 1.0, 0.0), "`lower`"),
    (lambda: clip.ValueClip(2.0, 1.0), "`lower`"),
    (lambda: clip.local_norm_clip(tf.ones(2), 0.0, 2), "`threshold`"),
    (lambda: clip.local_norm_clip(tf.ones(2), 1.0, 0), "`num_workers`"),
    (lambda: clip.adaptive_clip(tf.ones(2), tf.ones(2), clip_factor=0.0), "`clip_factor`"),
    (lambda: clip.adaptive_clip(tf.ones(2), tf.ones(2), eps=-1.0), "`eps`"),
    (lambda: clip.adaptive_clip(tf.ones(2), tf.ones(3)), "`grad` shape"),
    (lambda: clip.adaptive_clip(tf.ones((2, 2)), tf.ones((2, 2)), unit_axes=(2,)),
     "`unit_axes`"),
    (lambda: clip.unitwise_norm(tf.ones((2, 2)), unit_axes=(0, -2)), "`unit_axes`"),
    (lambda: clip.apply_rules([clip.AdaptiveClip()], [tf.ones(2)], [tf.ones(2)], [[]], 1,
                              unit_axes=[None, None]), "`unit_axes`"),
    (lambda: clip.VarianceClip(c=0.0), "`c`"),
    (lambda: clip.VarianceClip(decay=1.0), "`decay`"),
    (lambda: clip.MomentumClip(warmup_steps=0), "`warmup_steps`"),
    (lambda: clip.MomentumClip(factor=-1.0), "`factor`"),
    (lambda: clip.as_rules([clip.ValueClip(-1, 1), "norm"]), "`clipping`"),
    (lambda: clip.as_rules({"class_name": "Nope"}), "`clipping`"),
])
def test_bad_arguments_are_named(make, name):
    with pytest.raises((ValueError, TypeError), match=name):
        make()


def test_optimizer_rejects_bad_clipping_at_construction():
    with pytest.raises(TypeError, match="`clipping`"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), clipping="value", exchange="allgather")


# ------------------------------------------------------------------ in the optimizer


def _replica_apply(strategy, opt, var, grads_per_replica):
    """One ``opt.apply`` per replica with that replica's own gradient."""
    @tf.function
    def step():
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            g = tf.gather(tf.constant(np.stack(grads_per_replica)), rid)
            opt.apply([g], [var])
        strategy.run(fn)
    step()


@pytest.mark.parametrize("exchange, kwargs", [
    ("dense", {}), ("allgather", {"density": 1.0, "dense_below": 0}),
    ("shared", {"density": 1.0, "dense_below": 0})])
def test_clipping_is_per_replica_before_the_exchange(mirrored2, exchange, kwargs):
    g0 = np.array([[3.0, 4.0], [0.0, 0.0]], "float32")  # norm 5
    g1 = np.array([[0.0, 0.0], [0.3, 0.4]], "float32")  # norm 0.5
    rules = [clip.ValueClip(-3.5, 3.5), clip.LocalNormClip(2.0)]
    with mirrored2.scope():
        var = keras.Variable(np.zeros((2, 2), "float32"))
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(1.0), exchange=exchange,
                                        clipping=rules, **kwargs)
        opt.build([var])
    _replica_apply(mirrored2, opt, var, [g0, g1])

    def local(g):
        return np_local_norm_clip(np_value_clip(g, -3.5, 3.5), 2.0, 2)

    want = -(local(g0) + local(g1))
    np.testing.assert_allclose(var.numpy(), want, rtol=1e-6, atol=1e-7)
    after_sum = -np_local_norm_clip(np_value_clip(g0 + g1, -3.5, 3.5), 2.0, 2)
    assert not np.allclose(var.numpy(), after_sum, atol=1e-3)  # not clipping the aggregate


def test_per_replica_state_and_nonfinite_skip(mirrored2):
    with mirrored2.scope():
        var = keras.Variable(np.zeros((3,), "float32"))
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, dense_below=0,
                                        clipping=clip.MomentumClip(warmup_steps=1),
                                        exchange="allgather")
        opt.build([var])
    state = opt.clip_states[0][0]
    _replica_apply(mirrored2, opt, var, [np.full(3, 1.0, "float32"), np.full(3, 3.0, "float32")])
    per_replica = [s.numpy() for s in mirrored2.experimental_local_results(state.value)]
    np.testing.assert_allclose(per_replica[0], [np.sqrt(3.0), 1.0], rtol=1e-6)
    np.testing.assert_allclose(per_replica[1], [np.sqrt(27.0), 1.0], rtol=1e-6)
    bad = np.array([np.nan, 1.0, 1.0], "float32")
    _replica_apply(mirrored2, opt, var, [bad, np.full(3, 3.0, "float32")])
    after = [s.numpy() for s in mirrored2.experimental_local_results(state.value)]
    for a, b in zip(per_replica, after):
        np.testing.assert_array_equal(a, b)  # skipped step: clipping state untouched


def test_restored_clip_state_is_each_replicas_mean(mirrored2, tmp_path):
    # On-read SUM variables: the checkpoint holds the replicas' sum and a restore gives each
    # of the N replicas sum / N (documented in the clipping module and the README).
    rules = [clip.MomentumClip(warmup_steps=1), clip.VarianceClip(warmup_steps=1)]

    def make():
        with mirrored2.scope():
            var = keras.Variable(np.zeros((3,), "float32"))
            opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="dense",
                                            clipping=rules)
            opt.build([var])
        return var, opt

    def local(opt):
        return [np.stack([s.numpy() for s in mirrored2.experimental_local_results(st.value)])
                for st in opt.clip_states[0]]  # per rule: [replica, state_size]

    var, opt = make()
    for scale in (1.0, 2.0):  # different data per replica, so the states differ
        _replica_apply(mirrored2, opt, var, [np.full(3, scale, "float32"),
                                             np.full(3, 5.0 * scale, "float32")])
    saved = local(opt)
    assert all(not np.allclose(s[0], s[1]) for s in saved)
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))

    _, fresh = make()
    tf.train.Checkpoint(optimizer=fresh).read(path).assert_existing_objects_matched()
    for before, after in zip(saved, local(fresh)):
        for replica in after:
            np.testing.assert_allclose(replica, before.mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(after.sum(axis=0), before.sum(axis=0), rtol=1e-6)


def test_agc_units_in_the_optimizer_are_the_block_tables_blocks():
    # Conv2DTranspose kernel (kh, kw, filters, in): filters on axis -2; EinsumDense kernel
    # (in, heads, out) with "ab,bcd->acd": one unit per (head, out) pair.
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((3, 3, 2)), keras.layers.Conv2DTranspose(4, 2, name="up"),
        keras.layers.Flatten(),
        keras.layers.EinsumDense("ab,bcd->acd", output_shape=(2, 3), name="heads")])
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(1.0), exchange="dense",
                                    clipping=clip.AdaptiveClip(0.02), model=model)
    variables = model.trainable_variables
    opt.build(variables)
    rng = np.random.default_rng(0)
    grads = [(rng.standard_normal(v.shape) * rng.choice([0.01, 20.0], size=v.shape))
             .astype("float32") for v in variables]
    before = [v.numpy() for v in variables]
    opt.apply([tf.constant(g) for g in grads], variables)
    units = {"up/kernel": (2,), "up/bias": None, "heads/kernel": (1, 2)}
    for v, w, g in zip(variables, before, grads):
        name = "/".join(v.path.split("/")[-2:])
        want = np_agc(g, w, 0.02, unit_axes=units[name])
        np.testing.assert_allclose(w - v.numpy(), want, rtol=1e-4, atol=1e-6)
        if units[name] is not None:  # NFNets' by-rank default would have differed
            assert not np.allclose(np_agc(g, w, 0.02), want, rtol=1e-3)


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="a"),
                             keras.layers.Dense(2, name="b")])


def test_clip_state_checkpoint_and_config_round_trip(tmp_path):
    rules = [clip.AdaptiveClip(0.05), clip.VarianceClip(2.0, 0.9, 2),
             clip.MomentumClip(3.0, 0.8, 2)]
    model = _model()
    model.compile(optimizer=tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1,
                                                      clipping=rules,
                                                      exchange="allgather"), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)).astype("f"), rng.standard_normal((32, 2)).astype("f")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    saved = [[s.numpy() for s in vs] for vs in model.optimizer.clip_states]
    assert len(saved) == 4 and all(len(vs) == 2 for vs in saved)
    assert all(vs[0][2] == 4.0 and vs[1][1] == 4.0 for vs in saved)  # 4 steps counted
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.clipping == tuple(rules)
    for a, b in zip(saved, loaded.optimizer.clip_states):
        for x1, x2 in zip(a, b):
            np.testing.assert_array_equal(x1, x2.numpy())


# ------------------------------------------------------------------ overlap, structurally


def _graph_of_step(strategy, fusion_buffer_bytes):
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="first"),
            keras.layers.Flatten(), keras.layers.Dense(16, name="mid"),
            keras.layers.Dense(16, name="mid2"), keras.layers.Dense(3, name="last")])
        opt = tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(0.1), k=1, exchange="allgather",
            clipping=[clip.LocalNormClip(1.0), clip.AdaptiveClip()],
            fusion_buffer_bytes=fusion_buffer_bytes)
        opt.build(model.trainable_variables)

    @tf.function
    def step():
        def fn():
            x = tf.random.normal((4, 8, 8, 3))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x))) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
        strategy.run(fn)

    return step.get_concrete_function().graph


def _ancestors(op):
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        for nxt in [t.op for t in cur.inputs] + list(cur.control_inputs):
            if nxt.name not in seen:
                seen.add(nxt.name)
                stack.append(nxt)
    return seen


def _collectives_and_first_layer_grads(graph):
    ops = graph.get_operations()
    collectives = [op for op in ops if op.type.startswith("Collective")]
    first_grads = {op.name for op in ops if op.type == "Conv2DBackpropFilter"}
    return collectives, first_grads


def test_first_exchange_collective_does_not_wait_for_the_first_layer(mirrored2):
    # Backward order: last (bias, kernel), mid2, mid, first.  A small buffer makes groups of
    # the late layers whose collectives need none of the first layer's gradient.
    graph = _graph_of_step(mirrored2, fusion_buffer_bytes=1100)
    collectives, first_grads = _collectives_and_first_layer_grads(graph)
    assert first_grads and collectives
    independent = [c for c in collectives if not first_grads & _ancestors(c)]
    assert independent, "every collective waits for the first layer's gradient"
    assert len(independent) < len(collectives)  # the first layer's own group does wait
    # Without fusion groups (one exchange for all variables) everything waits.
    graph = _graph_of_step(mirrored2, fusion_buffer_bytes=None)
    collectives, first_grads = _collectives_and_first_layer_grads(graph)
    assert collectives and all(first_grads & _ancestors(c) for c in collectives)


def test_clip_after_all_reduce_clips_the_summed_gradients(mirrored2):
    """A plain SGD clips the replicas' sum ([3, 4] + [3, 4] = [6, 8], norm 10) to norm 5, so
    both replicas apply [3, 4]; Keras' global_clipnorm would clip each [3, 4] (norm 5) not at
    all and apply [6, 8]."""
    g = np.array([3.0, 4.0], "float32")
    with mirrored2.scope():
        var = keras.Variable(np.zeros((2,), "float32"))
        opt = keras.optimizers.SGD(1.0)
        opt.build([var])
    clipping_baseline.clip_after_all_reduce(opt, 5.0)
    _replica_apply(mirrored2, opt, var, [g, g])
    for value in mirrored2.experimental_local_results(var.value):
        np.testing.assert_allclose(value.numpy(), [-3.0, -4.0], rtol=1e-6)
    with pytest.raises(ValueError, match="clip_norm"):
        clipping_baseline.clip_after_all_reduce(keras.optimizers.SGD(1.0), 0.0)
