"""DGC momentum correction in the wrapper, against a NumPy reference on 2 real replicas."""

import dataclasses
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_blocksparse as tfbs
from models import registry
from tests import reference as ref
from tests import test_selection
from tests.test_optimizer_reference import (
    LR,
    MOMENTUM,
    STEPS,
    _data,
    _model,
    _read_only,
    _replica_grads,
    _run_distributed,
    _start,
)


def _train(strategy, inner_momentum=0.0, **opt_kwargs):
    return _run_distributed(strategy, inner_momentum=inner_momentum, **opt_kwargs)


@functools.cache
def _dense_values(strategy, inner_momentum=0.0):
    """Replica 0's weights after ``exchange="dense"`` over ``SGD(momentum=inner_momentum)``
    (trained once per module)."""
    model, _ = _train(strategy, inner_momentum=inner_momentum, exchange="dense")
    return [v.value.values[0].numpy() for v in model.trainable_variables]


def _reference(n, mode, k=None, density=None, granularity="block", masking="all",
               dense_below=0, whole_momentum=None):
    """Weights and ``[replica][variable]`` residuals and velocities after STEPS steps of the
    NumPy reference (computed once per module and argument set; the arrays are read-only)."""
    return _reference_once(n, mode, k, density, granularity, masking, dense_below,
                           whole_momentum)


@functools.cache
def _reference_once(n, mode, k, density, granularity, masking, dense_below, whole_momentum):
    layouts, start = _start()
    if granularity == "element":
        layouts = [dataclasses.replace(lay, rule=tfbs.blocks.ELEMENT) for lay in layouts]
    weights = list(start)
    residuals = [[np.zeros_like(w) for w in weights] for _ in range(n)]
    velocities = [[np.zeros_like(w) for w in weights] for _ in range(n)]
    for s in range(STEPS):
        grads = [_replica_grads(weights, *_data(s, r), n) for r in range(n)]
        updates, residuals, velocities, finite = ref.np_momentum_corrected_step(
            mode, grads, residuals, velocities, layouts, MOMENTUM, k, density,
            masking=masking, dense_below=dense_below, whole_momentum=whole_momentum)
        assert finite
        weights = [w - u * np.float32(LR) for w, u in zip(weights, updates)]
    return (_read_only(weights), [_read_only(rs) for rs in residuals],
            [_read_only(us) for us in velocities])


@pytest.mark.parametrize("mode,kwargs", [
    ("allgather", {"k": 1}), ("shared", {"density": 0.5}),
    ("allgather", {"density": 0.2, "granularity": "element"}),
    ("shared", {"k": 1, "masking": "none"}), ("allgather", {"k": 2, "masking": "waited"}),
    ("shared", {"density": 0.5, "masking": "waited"}),
    ("allgather", {"k": 1, "dense_below": 100}),
    ("shared", {"k": 1, "dense_below": 100, "masking": "waited"}),
    ("allgather", {"k": 1, "dense_below": 100, "masking": "compressed"}),
    ("shared", {"k": 3, "masking": "compressed"}),
    ("allgather", {"k": 1, "dense_below": 100, "masking": "whole"}),
    ("allgather", {"k": 1, "dense_below": 100, "masking": "whole_except_norm"}),
    ("allgather", {"k": 1, "dense_below": 100, "masking": "whole_vectors"}),
    ("allgather", {"k": 1, "dense_below": 100, "masking": "whole", "whole_momentum": 0.5}),
    ("shared", {"k": 1, "dense_below": 100, "masking": "whole_except_norm",
                "whole_momentum": 0.9})])
def test_matches_numpy_reference(mirrored2, mode, kwargs):
    kwargs = dict(kwargs)
    masking = kwargs.pop("masking", "all")
    dense_below = kwargs.pop("dense_below", 0)  # 0: every variable compressed
    whole_momentum = kwargs.pop("whole_momentum", None)
    if whole_momentum is None:
        policy = {"momentum_correction": MOMENTUM, "momentum_masking": masking}
    else:
        policy = {"momentum_correction": tfbs.MomentumCorrection(
            MOMENTUM, masking=masking, whole_momentum=whole_momentum)}
    model, opt = _train(mirrored2, exchange=mode, dense_below=dense_below, **policy, **kwargs)
    want_w, want_r, want_u = _reference(2, mode, masking=masking, dense_below=dense_below,
                                        whole_momentum=whole_momentum, **kwargs)
    if whole_momentum is not None:  # the case really differs from the masking without it
        plain_u = _reference(2, mode, masking=masking, dense_below=dense_below, **kwargs)[2]
        assert any(not np.array_equal(a, b) for ra, rb in zip(want_u, plain_u)
                   for a, b in zip(ra, rb))
    if masking != "all":  # the case really keeps momentum DGC's masking drops
        dgc_u = _reference(2, mode, masking="all", dense_below=dense_below, **kwargs)[2]
        assert any(not np.array_equal(a, b) for ra, rb in zip(want_u, dgc_u)
                   for a, b in zip(ra, rb))
    for got, want in zip(model.trainable_variables, want_w):
        for replica_value in got.value.values:
            np.testing.assert_allclose(replica_value.numpy(), want, rtol=2e-5, atol=2e-6)
    for states, want in ((opt.residuals, want_r), (opt.velocities, want_u)):
        for i, var in enumerate(states):
            for replica in range(2):
                np.testing.assert_allclose(var.value.values[replica].numpy(),
                                           want[replica][i], rtol=2e-5, atol=2e-6)
    # the velocities differ between replicas (local momentum), and sent blocks are masked;
    # under dense_below=100 only the Dense kernel (index 2) is compressed
    i = 2 if dense_below else 0
    assert not np.array_equal(opt.velocities[i].value.values[0].numpy(),
                              opt.velocities[i].value.values[1].numpy())


def test_dense_exchange_equals_global_momentum(mirrored2):
    """Local momentum summed over replicas is global momentum: same weights as SGD(m)."""
    corrected, _ = _train(mirrored2, exchange="dense", momentum_correction=MOMENTUM)
    for a, b in zip(corrected.trainable_variables, _dense_values(mirrored2, MOMENTUM)):
        np.testing.assert_allclose(a.value.values[0].numpy(), b, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="momentum_correction"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                  momentum_correction=0.9, exchange="allgather")
    for bad in (-0.1, 1.0, float("nan"), "0.9"):
        with pytest.raises(ValueError, match="momentum_correction"):
            tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), momentum_correction=bad,
                                      exchange="allgather")


def test_config_round_trip_and_state_in_variables():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, momentum_correction=0.8,
                                    exchange="allgather")
    clone = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert clone.momentum_correction == 0.8
    model = _model()
    clone.build(model.trainable_variables)
    assert len(clone.velocities) == len(model.trainable_variables)
    assert all(any(v is u for u in clone.variables) for v in clone.velocities)
    # without momentum correction there is no velocity state
    plain = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1, exchange="allgather")
    plain.build(_model().trainable_variables)
    assert plain.velocities == []


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_without_masking_density_one_is_momentum_sgd(mirrored2, mode):
    """Every block sent every step and the momentum kept whole: global momentum SGD's
    weights; with DGC's factor masking the momentum is lost instead (plain SGD)."""
    unmasked, _ = _train(mirrored2, exchange=mode, density=1.0, momentum_correction=MOMENTUM,
                         momentum_masking="none", dense_below=0)
    masked, _ = _train(mirrored2, exchange=mode, density=1.0, momentum_correction=MOMENTUM,
                       dense_below=0)
    for a, b, c, d in zip(unmasked.trainable_variables, _dense_values(mirrored2, MOMENTUM),
                          masked.trainable_variables, _dense_values(mirrored2)):
        np.testing.assert_allclose(a.value.values[0].numpy(), b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c.value.values[0].numpy(), d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["allgather", "shared"])
def test_waited_masking_at_density_one_is_momentum_sgd(mirrored2, mode):
    """Every block is sent every step, none ever waits: nothing is masked."""
    waited, _ = _train(mirrored2, exchange=mode, density=1.0, momentum_correction=MOMENTUM,
                       momentum_masking="waited", dense_below=0)
    for a, b in zip(waited.trainable_variables, _dense_values(mirrored2, MOMENTUM)):
        np.testing.assert_allclose(a.value.values[0].numpy(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["no", True, None])
def test_momentum_masking_is_named(bad):
    with pytest.raises(ValueError, match="momentum_masking"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), momentum_correction=0.9,
                                  momentum_masking=bad, exchange="allgather")


def test_default_masking_follows_recurrent_whole():
    """``momentum_masking`` defaults to ``"none"`` when recurrent layers are sent whole (what
    converged on the GRU and LSTM translation models) and to ``"whole"`` otherwise; an
    explicit masking, in either form, is kept, and the resolved one survives a config round
    trip."""
    def masking(inner=None, **kwargs):
        return tfbs.BlockSparseOptimizer(inner or keras.optimizers.SGD(0.1, momentum=0.9),
                                         exchange="allgather", **kwargs)

    assert masking().momentum_masking == "whole"
    assert masking(recurrent="compress").momentum_masking == "whole"
    assert masking(recurrent="whole").momentum_masking == "none"
    assert masking(recurrent="whole", momentum_masking="auto").momentum_masking == "none"
    assert masking(momentum_masking="auto").momentum_masking == "whole"
    for explicit in ("all", "waited", "none", "compressed"):
        assert masking(recurrent="whole", momentum_masking=explicit).momentum_masking \
            == explicit
    assert masking(inner=keras.optimizers.SGD(0.1), recurrent="whole",
                   momentum_correction=tfbs.MomentumCorrection(0.9)).momentum_masking == "none"
    assert masking(inner=keras.optimizers.SGD(0.1), recurrent="whole",
                   momentum_correction=tfbs.MomentumCorrection(0.9, masking="all")
                   ).momentum_masking == "all"
    assert tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=(
        tfbs.CompressionOptions(exchange="allgather", recurrent="whole"))
    ).momentum_masking == "none"
    opt = masking(recurrent="whole")
    assert opt.get_config()["momentum_correction"]["masking"] == "none"
    assert tfbs.BlockSparseOptimizer.from_config(opt.get_config()).momentum_masking == "none"


def _draw_momenta_and_sent(lays, data):
    """Per layout a momentum [*shape] and the sent block ids: per variable nothing known
    (``None``), a few blocks, or every block."""
    us = [tf.constant(test_selection._data(data.draw(st.integers(0, 2**16)), lay.shape))
          for lay in lays]
    sent = []
    for lay in lays:
        count = data.draw(st.sampled_from([None, *range(1, lay.num_blocks + 1)]))
        sent.append(None if count is None else tf.constant(
            sorted(data.draw(st.permutations(range(lay.num_blocks)))[:count]), tf.int32))
    return us, sent


@given(lays=st.lists(test_selection.layouts(max_rank=3), min_size=1, max_size=4),
       data=st.data())
@settings(max_examples=30, deadline=None)
def test_compressed_and_whole_maskings_split_dgc_masking(lays, data):
    """``"compressed"`` and ``"whole"`` each mask a disjoint part of what ``"all"`` masks
    (a variable whose every block is sent belongs to ``"whole"``), so applying both is
    DGC's masking and every variable the one leaves alone is bit-exact."""
    us, sent = _draw_momenta_and_sent(lays, data)
    policy = {m: tfbs.MomentumCorrection(0.9, masking=m)
              for m in ("all", "compressed", "whole", "none")}
    every = [ids is not None and int(ids.shape[0]) == lay.num_blocks
             for ids, lay in zip(sent, lays)]
    got_all = policy["all"].mask(us, lays, sent, None)
    comp = policy["compressed"].mask(us, lays, sent, None)
    whole = policy["whole"].mask(us, lays, sent, None)
    both = policy["whole"].mask(comp, lays, sent, None)
    for i, flag in enumerate(every):
        np.testing.assert_array_equal(both[i].numpy(), got_all[i].numpy())
        np.testing.assert_array_equal((comp if flag else whole)[i].numpy(), us[i].numpy())
        np.testing.assert_array_equal((whole if flag else comp)[i].numpy(),
                                      got_all[i].numpy())
    assert all(a is b for a, b in zip(policy["none"].mask(us, lays, sent, None), us))


@given(lays=st.lists(test_selection.layouts(max_rank=3), min_size=1, max_size=4),
       data=st.data())
@settings(max_examples=30, deadline=None)
def test_whole_except_norm_keeps_normalisation_momentum(lays, data):
    """``"whole_except_norm"`` is ``"whole"`` on every variable that is no normalisation
    layer's, and leaves the normalisation layers' momenta bit-exact (NumPy reference:
    the reference's zeroing of the blocks ``"whole"`` masks, on the other variables)."""
    classes = (None, "Dense", "Conv2D", "BatchNormalization", "LayerNormalization",
               "GroupNormalization")
    lays = [dataclasses.replace(lay, layer_class=data.draw(st.sampled_from(classes)))
            for lay in lays]
    us, sent = _draw_momenta_and_sent(lays, data)
    got = tfbs.MomentumCorrection(0.9, masking="whole_except_norm").mask(us, lays, sent, None)
    whole = tfbs.MomentumCorrection(0.9, masking="whole").mask(us, lays, sent, None)
    for g, w, u, lay, ids in zip(got, whole, us, lays, sent):
        norm = ref.np_is_normalization(lay)
        assert lay.normalization == norm
        every = ids is not None and int(ids.shape[0]) == lay.num_blocks
        want = u.numpy() if norm or not every else ref.np_zero_blocks(
            u.numpy(), lay, ids.numpy())
        np.testing.assert_array_equal(g.numpy(), want)
        if not norm:
            np.testing.assert_array_equal(g.numpy(), w.numpy())


@given(lays=st.lists(test_selection.layouts(max_rank=3), min_size=1, max_size=4),
       data=st.data())
@settings(max_examples=30, deadline=None)
def test_whole_vectors_masks_only_vectors(lays, data):
    """``"whole_vectors"`` is ``"whole"`` on the variables whose blocks are single elements
    (whatever their rank) and leaves every other momentum bit-exact (NumPy reference: the
    zeroing of the blocks ``"whole"`` masks, on those variables)."""
    us, sent = _draw_momenta_and_sent(lays, data)
    got = tfbs.MomentumCorrection(0.9, masking="whole_vectors").mask(us, lays, sent, None)
    whole = tfbs.MomentumCorrection(0.9, masking="whole").mask(us, lays, sent, None)
    for g, w, u, lay, ids in zip(got, whole, us, lays, sent):
        outer, _, inner = ref._view_shape(lay)
        vector = outer * inner == 1
        every = ids is not None and int(ids.shape[0]) == lay.num_blocks
        want = ref.np_zero_blocks(u.numpy(), lay, ids.numpy()) if vector and every \
            else u.numpy()
        np.testing.assert_array_equal(g.numpy(), want)
        if vector:
            np.testing.assert_array_equal(g.numpy(), w.numpy())


def _norm_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, use_bias=False),
        keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Flatten(),
        keras.layers.Dense(5, activation="tanh"), keras.layers.LayerNormalization(),
        keras.layers.Dense(3)])


def _one_step_velocities(strategy, masking):
    """Replica 0's local momenta after one ``model.fit`` step of :func:`_norm_model` (k=1,
    ``dense_below=40``: the conv and Dense(5) kernels compressed, the rest sent whole)."""
    with strategy.scope():
        model = _norm_model()
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), k=1,
                                        exchange="allgather", dense_below=40,
                                        momentum_masking=masking)
        model.compile(opt, loss="mse")
    x, y = _data(0, 0)
    model.fit(np.concatenate([x, x * 0.5]), np.concatenate([y, -y]), batch_size=8,
              epochs=1, shuffle=False, verbose=0)
    return ([u.value.values[0].numpy() for u in opt.velocities],
            tfbs.blocks.layouts_for(model.trainable_variables, model))


def test_whole_except_norm_in_model_fit(mirrored2):
    """One real step on 2 replicas: the BatchNorm and LayerNorm scales and offsets keep
    their momentum (``"none"``'s), every other variable is masked as ``"whole"`` masks it."""
    got, lays = _one_step_velocities(mirrored2, "whole_except_norm")
    whole, _ = _one_step_velocities(mirrored2, "whole")
    none, _ = _one_step_velocities(mirrored2, "none")
    norms = [lay.normalization for lay in lays]
    assert sum(norms) == 4  # BatchNorm's and LayerNorm's gamma and beta
    assert any(lay.size >= 40 for lay in lays)  # a compressed variable
    for g, w, n, lay, is_norm in zip(got, whole, none, lays, norms):
        np.testing.assert_array_equal(g, n if is_norm else w)
        if lay.size < 40:  # sent whole: masked entirely, or kept whole
            assert np.any(g != 0) if is_norm else not np.any(g)


def test_whole_vectors_in_model_fit(mirrored2):
    """One real step on 2 replicas: the vectors sent whole (biases, BatchNorm's and
    LayerNorm's scales and offsets) are masked as ``"whole"`` masks them, the kernel sent
    whole (Dense(3)'s) keeps its momentum (``"none"``'s), the compressed kernels are as in
    both."""
    got, lays = _one_step_velocities(mirrored2, "whole_vectors")
    whole, _ = _one_step_velocities(mirrored2, "whole")
    none, _ = _one_step_velocities(mirrored2, "none")
    whole_kernels = [lay.size < 40 and lay.block_size > 1 for lay in lays]
    assert sum(whole_kernels) == 1  # Dense(3)'s kernel [5, 3]
    assert sum(lay.size < 40 and lay.block_size == 1 for lay in lays) >= 6
    for g, w, n, lay, kernel in zip(got, whole, none, lays, whole_kernels):
        np.testing.assert_array_equal(g, n if kernel else w)
        if lay.size < 40:  # sent whole: kept whole, or masked entirely
            assert np.any(g != 0) if kernel else not np.any(g)


@pytest.mark.parametrize("name", ["cnn_small", "cnn_bn", "resnet20"])
def test_whole_vectors_are_the_rank_one_variables_of_the_benchmark_cnns(name):
    """On these models the variables of one-element blocks are exactly those of rank 1 (the
    test ``"whole_vectors"`` made when its committed runs were trained), and some kernels
    are small enough to be sent whole, so it differs from ``"whole"`` there."""
    model = registry.build_image_model(name)
    lays = tfbs.blocks.layouts_for(model.trainable_variables, model)
    assert [lay.block_size == 1 for lay in lays] == [len(lay.shape) == 1 for lay in lays]
    assert any(lay.block_size > 1 and lay.size < tfbs.CompressionOptions().dense_below
               for lay in lays)


@given(lays=st.lists(test_selection.layouts(max_rank=3), min_size=1, max_size=4),
       w=st.sampled_from([0.0, 0.3, 0.7, 0.9]), data=st.data())
@settings(max_examples=30, deadline=None)
def test_whole_momentum_scales_what_whole_zeroes(lays, w, data):
    """With ``whole_momentum`` the variables ``"whole"`` masks (every block sent) keep
    ``u * whole_momentum / momentum`` (NumPy reference), and every other momentum is
    bit-exact; 0 is ``"whole"`` itself."""
    us, sent = _draw_momenta_and_sent(lays, data)
    got = tfbs.MomentumCorrection(0.9, masking="whole", whole_momentum=w).mask(
        us, lays, sent, None)
    whole = tfbs.MomentumCorrection(0.9, masking="whole").mask(us, lays, sent, None)
    for g, z, u, lay, ids in zip(got, whole, us, lays, sent):
        every = ids is not None and int(ids.shape[0]) == lay.num_blocks
        u = u.numpy()
        want = u * np.asarray(w / 0.9, u.dtype) if every and w else z.numpy()
        np.testing.assert_array_equal(g.numpy(), want)
        if not every:
            np.testing.assert_array_equal(g.numpy(), u)


def test_whole_momentum_arguments_are_named_and_saved():
    for bad in (-0.1, 1.0, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="whole_momentum"):
            tfbs.MomentumCorrection(0.9, masking="whole", whole_momentum=bad)
    for masking in ("all", "none", "waited", "compressed"):
        with pytest.raises(ValueError, match="whole_momentum.*masking"):
            tfbs.MomentumCorrection(0.9, masking=masking, whole_momentum=0.5)
    with pytest.raises(ValueError, match="whole_momentum.*exceed"):
        tfbs.MomentumCorrection(0.5, masking="whole", whole_momentum=0.7)
    with pytest.raises(ValueError, match="whole_momentum.*exceed"):  # the inner SGD's, moved
        tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.5), exchange="allgather",
            momentum_correction=tfbs.MomentumCorrection(whole_momentum=0.7))
    opt = tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), exchange="allgather",
        momentum_correction=tfbs.MomentumCorrection(whole_momentum=0.7))
    assert opt.momentum_policy == tfbs.MomentumCorrection(0.9, "whole", 0.7)
    clone = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert clone.momentum_policy == opt.momentum_policy
    # "auto" resolved to "none" (recurrent layers sent whole) masks nothing: no factor kept
    rec = tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), exchange="allgather", recurrent="whole",
        momentum_correction=tfbs.MomentumCorrection(whole_momentum=0.7))
    assert rec.momentum_policy == tfbs.MomentumCorrection(0.9, "none")
