"""tf_blocksparse.selection and feedback.BlockTopK against the NumPy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import reference as ref
from tf_blocksparse import blocks, selection
from tf_blocksparse.feedback import BlockTopK, Payload, validate_k_density

SETTINGS = settings(max_examples=30, deadline=None)
RULE_NAMES = sorted(blocks.RULES)


# ---------------------------------------------------------------------------------------
# Strategies: a random layout (rank 0..4, every rule) and exactly representable data.
# ---------------------------------------------------------------------------------------

@st.composite
def layouts(draw, max_rank: int = 4, max_dim: int = 5) -> blocks.BlockLayout:
    shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=0, max_size=max_rank)))
    rule = blocks.RULES[draw(st.sampled_from(RULE_NAMES))]
    return blocks.BlockLayout("v", shape, rule)


def _data(seed: int, shape, low: int = -24, high: int = 25) -> np.ndarray:
    """Integers / 8: every sum of a few of them (and their squares) is exact in float32."""
    rng = np.random.default_rng(seed)
    return (rng.integers(low, high, size=shape) / 8).astype(np.float32)


def _both(fn, *args):
    """``fn(*args)`` eagerly and inside a ``tf.function``, as NumPy arrays."""
    return fn(*args).numpy(), tf.function(fn)(*args).numpy()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


# ---------------------------------------------------------------------------------------
# num_selected.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("nb,k,density,want", [
    (10, None, None, 1),      # default k=1
    (10, 3, None, 3),
    (3, 5, None, 3),          # k clipped to the block count
    (1, 4, None, 1),
    (10, None, 0.25, 3),      # ceil(2.5)
    (8, None, 0.25, 2),       # exact
    (7, None, 0.5, 4),        # ceil(3.5)
    (10, None, 0.01, 1),      # ceil(0.1) = 1
    (1000, None, 1e-6, 1),    # the "at least 1" floor
    (10, None, 1.0, 10),
    (1, None, 0.5, 1),
])
def test_num_selected(nb, k, density, want):
    assert selection.num_selected(nb, k, density) == want
    assert ref.np_num_selected(nb, k, density) == want


@SETTINGS
@given(nb=st.integers(1, 500), k=st.one_of(st.none(), st.integers(1, 600)),
       density=st.one_of(st.none(), st.floats(1e-4, 1.0)))
def test_num_selected_matches_reference(nb, k, density):
    if k is not None and density is not None:
        density = None
    n = selection.num_selected(nb, k, density)
    assert 1 <= n <= nb
    assert n == ref.np_num_selected(nb, k, density)


# ---------------------------------------------------------------------------------------
# Scores and top-k.
# ---------------------------------------------------------------------------------------

@SETTINGS
@given(lay=layouts(), metric=st.sampled_from(selection.METRICS), seed=st.integers(0, 2**16))
def test_block_scores(lay, metric, seed):
    x = _data(seed, lay.shape)
    want = ref.np_scores(x, lay, metric)
    assert want.shape == (lay.num_blocks,)
    for got in _both(lambda t: selection.block_scores(t, lay, metric), tf.constant(x)):
        assert got.shape == (lay.num_blocks,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_block_scores_half_precision_in_float32_and_bad_metric():
    lay = blocks.BlockLayout("v", (3, 4), blocks.OUTPUT_CHANNEL)
    x = _data(0, lay.shape)
    got = selection.block_scores(tf.constant(x, tf.float16), lay, "l2")
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), ref.np_scores(x, lay, "l2"), rtol=1e-6)
    with pytest.raises(ValueError, match="metric"):
        selection.block_scores(tf.constant(x), lay, "linf")


@SETTINGS
@given(scores=st.lists(st.integers(0, 6), min_size=1, max_size=40), data=st.data())
def test_top_blocks(scores, data):
    # Small integer scores: plenty of ties, which must go to the lower id.
    s = np.asarray(scores, np.float32) / 4
    k = data.draw(st.integers(1, s.size))
    want = ref.np_topk(s, k)
    for got in _both(lambda t: selection.top_blocks(t, k), tf.constant(s)):
        assert got.dtype == np.int32 and got.shape == (k,)
        if k == 1:
            np.testing.assert_array_equal(got, want)
            assert got[0] == int(np.argmax(s))
        else:
            assert set(got.tolist()) == set(want.tolist())


def test_top_blocks_ties_go_to_the_lower_id():
    s = tf.constant([1.0, 3.0, 2.0, 3.0, 3.0, 0.0])
    assert selection.top_blocks(s, 1).numpy().tolist() == [1]
    assert sorted(selection.top_blocks(s, 2).numpy().tolist()) == [1, 3]
    assert sorted(selection.top_blocks(s, 4).numpy().tolist()) == [1, 2, 3, 4]
    z = tf.zeros((7,))
    assert sorted(selection.top_blocks(z, 3).numpy().tolist()) == [0, 1, 2]


# ---------------------------------------------------------------------------------------
# Gather, scatter, zero.
# ---------------------------------------------------------------------------------------

@SETTINGS
@given(lay=layouts(), seed=st.integers(0, 2**16), data=st.data())
def test_gather_blocks(lay, seed, data):
    x = _data(seed, lay.shape)
    ids = np.asarray(data.draw(st.lists(st.integers(0, lay.num_blocks - 1), min_size=1,
                                        max_size=6)), np.int32)
    want = ref.np_gather(x, lay, ids)
    assert want.shape == (ids.size, lay.block_size)
    for got in _both(lambda t, i: selection.gather_blocks(t, lay, i), tf.constant(x),
                     tf.constant(ids)):
        np.testing.assert_array_equal(_bits(got), _bits(want))


@SETTINGS
@given(lay=layouts(), seed=st.integers(0, 2**16), data=st.data())
def test_scatter_blocks_repeated_ids_add(lay, seed, data):
    ids = np.asarray(data.draw(st.lists(st.integers(0, lay.num_blocks - 1), min_size=1,
                                        max_size=8)), np.int32)
    values = _data(seed, (ids.size, lay.block_size))
    want = ref.np_scatter(values, ids, lay)
    assert want.shape == lay.shape
    for got in _both(lambda v, i: selection.scatter_blocks(v, i, lay), tf.constant(values),
                     tf.constant(ids)):
        assert got.shape == lay.shape
        np.testing.assert_array_equal(got, want)


def test_scatter_then_gather_round_trip():
    lay = blocks.BlockLayout("v", (2, 3, 4, 5), blocks.TRANSPOSE_FILTER)
    x = _data(3, lay.shape)
    ids = tf.constant([3, 0], tf.int32)
    dense = selection.scatter_blocks(selection.gather_blocks(tf.constant(x), lay, ids), ids,
                                     lay).numpy()
    v, want = ref.np_view(dense, lay), ref.np_view(x, lay)
    np.testing.assert_array_equal(v[:, [0, 3], :], want[:, [0, 3], :])
    assert not v[:, [1, 2], :].any()


def _check_zero(lay: blocks.BlockLayout, x: np.ndarray, ids: np.ndarray) -> None:
    want = ref.np_zero_blocks(x, lay, ids)
    for got in _both(lambda t, i: selection.zero_blocks(t, lay, i), tf.constant(x),
                     tf.constant(ids)):
        assert got.shape == lay.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))  # others bit-exact
        assert not ref.np_view(got, lay)[:, ids, :].any()


@SETTINGS
@given(lay=layouts(), seed=st.integers(0, 2**16), data=st.data())
def test_zero_blocks(lay, seed, data):
    x = _data(seed, lay.shape)
    ids = np.asarray(data.draw(st.lists(st.integers(0, lay.num_blocks - 1), min_size=1,
                                        max_size=lay.num_blocks, unique=True)), np.int32)
    _check_zero(lay, x, ids)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("path", ["scatter", "where"])
def test_zero_blocks_both_paths(rule, path):
    lay = blocks.BlockLayout("v", (5, 4, 8, 6), blocks.RULES[rule])
    nb = lay.num_blocks
    k = max(1, nb // 4) if path == "scatter" else nb // 4 + 1
    if path == "scatter":
        assert 4 * k <= nb or nb == 1
    else:
        assert 4 * k > nb
    ids = np.random.default_rng(nb).permutation(nb)[:k].astype(np.int32)
    x = _data(nb, lay.shape)
    x[x == 0] = 0.5  # every untouched entry non-zero, so stray zeros would show
    _check_zero(lay, x, ids)


def test_zero_blocks_keeps_nan_and_negative_zero_bits_outside():
    lay = blocks.BlockLayout("v", (2, 8, 3), blocks.TRANSPOSE_FILTER)
    x = _data(1, lay.shape)
    x[0, 5, 0], x[1, 6, 2], x[0, 0, 1] = np.nan, -0.0, np.inf
    _check_zero(lay, x, np.asarray([2], np.int32))                     # scatter path
    _check_zero(lay, x, np.asarray([2, 3, 4], np.int32))               # where path


# ---------------------------------------------------------------------------------------
# BlockTopK: conservation and agreement with the reference.
# ---------------------------------------------------------------------------------------

@st.composite
def compressors(draw):
    lays = [blocks.BlockLayout(f"v{i}", lay.shape, lay.rule)
            for i, lay in enumerate(draw(st.lists(layouts(), min_size=1, max_size=3)))]
    if draw(st.booleans()):
        kw = {"k": draw(st.integers(1, 6))}
    else:
        kw = {"density": draw(st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0]))}
    return lays, kw, draw(st.sampled_from(selection.METRICS))


def _sorted_by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, kind="stable")
    return ids[order], values[order]


@SETTINGS
@given(spec=compressors(), seed=st.integers(0, 2**16), jit=st.booleans())
def test_compress_conserves_and_matches_reference(spec, seed, jit):
    lays, kw, metric = spec
    comp = BlockTopK(lays, metric=metric, **{"dense_below": 0, **kw})
    grads = [_data(seed + i, lay.shape) for i, lay in enumerate(lays)]
    state = [_data(seed + 100 + i, lay.shape, -8, 9) for i, lay in enumerate(lays)]

    def run(g, s):
        payload, new_state = comp.compress(g, s)
        return payload.ids, payload.values, comp.decompress(payload), new_state

    fn = tf.function(run) if jit else run
    ids, values, dense, new_state = fn([tf.constant(g) for g in grads],
                                       [tf.constant(s) for s in state])
    for i, lay in enumerate(lays):
        acc = grads[i] + state[i]                  # exact: multiples of 1/8, small
        got_ids, got_vals = ids[i].numpy(), values[i].numpy()
        d, r = dense[i].numpy(), new_state[i].numpy()
        count = ref.np_num_selected(lay.num_blocks, **kw)
        assert got_ids.shape == (count,) and got_vals.shape == (count, lay.block_size)
        assert len(set(got_ids.tolist())) == count
        # Conservation, exactly.
        assert np.array_equal(d + r, acc)
        assert not ref.np_view(r, lay)[:, got_ids, :].any()
        assert not np.delete(ref.np_view(d, lay), got_ids, axis=1).any()
        # The reference makes the same choice.
        want_ids, want_vals, want_res = ref.np_compress(grads[i], state[i], lay,
                                                        metric=metric, **kw)
        a, b = _sorted_by_id(got_ids, got_vals), _sorted_by_id(want_ids, want_vals)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(r, want_res)


@SETTINGS
@given(spec=compressors(), seed=st.integers(0, 2**16))
def test_compress_conserves_arbitrary_floats(spec, seed):
    """Any float data: decompress(payload) + new_state == grad + state (TF's acc) exactly."""
    lays, kw, metric = spec
    comp = BlockTopK(lays, metric=metric, **{"dense_below": 0, **kw})
    rng = np.random.default_rng(seed)
    grads = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32) * 1e3)
             for lay in lays]
    state = [tf.constant(rng.standard_normal(lay.shape).astype(np.float32) * 1e-3)
             for lay in lays]
    payload, new_state = comp.compress(grads, state)
    prepared = comp.prepare(grads, state)
    for d, r, acc in zip(comp.decompress(payload), new_state, prepared.accs):
        assert np.array_equal(d.numpy() + r.numpy(), acc.numpy())


def test_init_and_payload_types():
    lays = [blocks.BlockLayout("a", (4, 3), blocks.OUTPUT_CHANNEL),
            blocks.BlockLayout("b", (5,), blocks.ELEMENT)]
    comp = BlockTopK(lays, density=0.5, dense_below=0)
    state = comp.init()
    assert [tuple(s.shape) for s in state] == [(4, 3), (5,)]
    assert comp.counts == (2, 3)
    payload, _ = comp.compress([tf.ones((4, 3)), tf.ones((5,))], state)
    assert isinstance(payload, Payload)
    assert [tuple(v.shape) for v in payload.values] == [(2, 4), (3, 1)]


# ---------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------

def _comp() -> BlockTopK:
    return BlockTopK([blocks.BlockLayout("m/a", (4, 3), blocks.OUTPUT_CHANNEL),
                      blocks.BlockLayout("m/b", (5,), blocks.ELEMENT)], k=1,
                     dense_below=0)


def test_compress_wrong_number_of_tensors():
    comp = _comp()
    good = [tf.zeros((4, 3)), tf.zeros((5,))]
    with pytest.raises(ValueError, match="`grads`"):
        comp.compress(good[:1], comp.init())
    with pytest.raises(ValueError, match="`state`"):
        comp.compress(good, comp.init()[:1])


def test_compress_wrong_shape():
    comp = _comp()
    good = [tf.zeros((4, 3)), tf.zeros((5,))]
    with pytest.raises(ValueError, match="`grads`.*m/a"):
        comp.compress([tf.zeros((3, 4)), tf.zeros((5,))], comp.init())
    with pytest.raises(ValueError, match="`state`.*m/b"):
        comp.compress(good, [tf.zeros((4, 3)), tf.zeros((6,))])


@pytest.mark.parametrize("kwargs,name", [
    ({"k": 0}, "`k`"), ({"k": -2}, "`k`"), ({"k": 1.5}, "`k`"), ({"k": True}, "`k`"),
    ({"density": 0}, "`density`"), ({"density": 0.0}, "`density`"),
    ({"density": 1.5}, "`density`"), ({"density": -0.1}, "`density`"),
    ({"density": True}, "`density`"), ({"density": math.nan}, "`density`"),
    ({"k": 2, "density": 0.5}, "`k` and `density`"),
])
def test_validate_k_density_errors(kwargs, name):
    args = {"k": None, "density": None, **kwargs}
    with pytest.raises(ValueError, match=name):
        validate_k_density(args["k"], args["density"])
    with pytest.raises(ValueError, match=name):
        BlockTopK([blocks.BlockLayout("v", (3,), blocks.ELEMENT)], **kwargs)


def test_validate_k_density_accepts():
    assert validate_k_density(None, None) == (1, None)
    assert validate_k_density(3, None) == (3, None)
    assert validate_k_density(None, 1) == (None, 1.0)
    assert validate_k_density(None, 0.5) == (None, 0.5)


def test_bad_metric():
    with pytest.raises(ValueError, match="`metric`"):
        BlockTopK([blocks.BlockLayout("v", (3,), blocks.ELEMENT)], metric="max")


# ---------------------------------------------------------------------------------------
# The reference itself, and one exchange step on the default (single) replica context.
# ---------------------------------------------------------------------------------------

@SETTINGS
@given(spec=compressors(), seed=st.integers(0, 2**16), n=st.integers(1, 3),
       mode=st.sampled_from(["allgather", "shared"]))
def test_reference_step_conserves_over_replicas(spec, seed, n, mode):
    lays, kw, metric = spec
    grads = [[_data(seed + 10 * r + i, lay.shape) for i, lay in enumerate(lays)]
             for r in range(n)]
    res = [[_data(seed + 10 * r + i + 5, lay.shape, -8, 9) for i, lay in enumerate(lays)]
           for r in range(n)]
    updates, new_res, finite = ref.np_step(mode, grads, res, lays, metric=metric, **kw)
    assert finite
    for i, lay in enumerate(lays):
        total_acc = sum(grads[r][i] + res[r][i] for r in range(n))
        np.testing.assert_array_equal(updates[i] + sum(new_res[r][i] for r in range(n)),
                                      total_acc)
        count = ref.np_num_selected(lay.num_blocks, **kw)
        if mode == "shared":  # one common set of zeroed blocks
            zeroed = [set(np.flatnonzero(~ref.np_view(new_res[r][i], lay).any(axis=(0, 2))))
                      for r in range(n)]
            common = set.intersection(*zeroed)
            assert len(common) >= count
    dense, flushed, _ = ref.np_step("dense", grads, res, lays)  # residuals go out too
    for i in range(len(lays)):
        np.testing.assert_array_equal(dense[i], sum(g[i] + rr[i] for g, rr in zip(grads, res)))
        for r in range(n):
            np.testing.assert_array_equal(flushed[r][i], np.zeros_like(res[r][i]))


def test_reference_step_flags_non_finite():
    lay = blocks.BlockLayout("v", (4,), blocks.ELEMENT)
    g = [[np.asarray([1.0, np.nan, 0.0, 2.0], np.float32)], [np.ones(4, np.float32)]]
    r = [[np.zeros(4, np.float32)], [np.zeros(4, np.float32)]]
    for mode in ("allgather", "shared", "dense"):
        assert ref.np_step(mode, g, r, [lay], k=1)[2] is False


@pytest.mark.parametrize("mode", ["allgather", "shared", "dense"])
def test_single_replica_exchange_matches_reference(mode):
    from tf_blocksparse import exchange

    lays = [blocks.BlockLayout("m/k", (3, 3, 2, 4), blocks.OUTPUT_CHANNEL),
            blocks.BlockLayout("m/t", (2, 2, 5, 3), blocks.TRANSPOSE_FILTER),
            blocks.BlockLayout("m/b", (6,), blocks.ELEMENT)]
    comp = BlockTopK(lays, density=0.5, metric="l2", dense_below=0)
    grads = [_data(i, lay.shape) for i, lay in enumerate(lays)]
    state = [_data(i + 10, lay.shape, -8, 9) for i, lay in enumerate(lays)]
    out = exchange.run_exchange(mode, tf.distribute.get_replica_context(), comp,
                                [tf.constant(g) for g in grads],
                                [tf.constant(s) for s in state])
    updates, residuals, finite = ref.np_step(mode, [grads], [state], lays, density=0.5,
                                             metric="l2")
    assert bool(out.finite.numpy()) == finite
    for got, want in zip(out.updates, updates):
        np.testing.assert_array_equal(got.numpy(), want)
    if mode != "dense":
        for got, want in zip(out.residuals, residuals[0]):
            np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("mode", ["allgather", "shared"])
@pytest.mark.parametrize("dense_below", [0, 65, 10**6])
def test_single_replica_exchange_with_whole_variables(mode, dense_below):
    """dense_below=65: the 60- and 6-element variables are summed whole (no ids, no
    scores), the 72-element one keeps half its blocks; 10**6: all whole, one buffer."""
    from tf_blocksparse import exchange

    lays = [blocks.BlockLayout("m/k", (3, 3, 2, 4), blocks.OUTPUT_CHANNEL),
            blocks.BlockLayout("m/t", (2, 2, 5, 3), blocks.TRANSPOSE_FILTER),
            blocks.BlockLayout("m/b", (6,), blocks.ELEMENT)]
    comp = BlockTopK(lays, density=0.5, dense_below=dense_below)
    assert comp.whole == tuple(lay.size < dense_below for lay in lays)
    grads = [_data(i, lay.shape) for i, lay in enumerate(lays)]
    state = [_data(i + 10, lay.shape, -8, 9) for i, lay in enumerate(lays)]
    out = exchange.run_exchange(mode, tf.distribute.get_replica_context(), comp,
                                [tf.constant(g) for g in grads],
                                [tf.constant(s) for s in state])
    sent: list = []
    updates, residuals, finite = ref.np_step(mode, [grads], [state], lays, density=0.5,
                                             sent=sent, dense_below=dense_below)
    assert bool(out.finite.numpy()) == finite
    for got, want in zip(out.updates, updates):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want in zip(out.residuals, residuals[0]):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want, whole in zip(out.sent_ids, sent[0], comp.whole):
        if whole:  # every block, in order
            np.testing.assert_array_equal(got.numpy(), np.arange(len(want)))
        np.testing.assert_array_equal(np.sort(got.numpy()), np.sort(want))
    assert out.payload_bytes == ref.np_payload_bytes(mode, lays, density=0.5,
                                                     dense_below=dense_below)
    assert out.blocks_kept == sum(comp.counts)


def test_whole_variables_payload_bytes_in_the_reference():
    lays = [blocks.BlockLayout("m/k", (3, 3, 2, 4), blocks.OUTPUT_CHANNEL),  # 4 blocks of 18
            blocks.BlockLayout("m/b", (6,), blocks.ELEMENT)]
    # k=1: ids 1 + flag | scores 4, one 18-value block, and the 6-element bias whole.
    assert ref.np_payload_bytes("allgather", lays, k=1, dense_below=7) == 4 * (2 + 18 + 6)
    assert ref.np_payload_bytes("shared", lays, k=1, dense_below=7) == 4 * (4 + 18 + 6)
    assert ref.np_payload_bytes("allgather", lays, k=1) == 4 * (3 + 18 + 1)
    for mode in ("allgather", "shared", "dense"):
        assert ref.np_payload_bytes(mode, lays, k=1, dense_below=100) == 4 * 78


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_reference_sgd_matches_keras(momentum):
    import keras

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((3, 4)).astype(np.float32)
    var = keras.Variable(w0)
    opt = keras.optimizers.SGD(0.05, momentum=momentum)
    opt.build([var])
    w, m = w0, np.zeros_like(w0)
    for _ in range(3):
        g = rng.standard_normal((3, 4)).astype(np.float32)
        opt.apply_gradients([(tf.constant(g), var)])
        w, m = ref.np_sgd_momentum(w, m, g, 0.05, momentum)
        np.testing.assert_array_equal(var.numpy(), w)
