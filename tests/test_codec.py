"""Tests for tf_blocksparse.codec."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def _load_codec():
    try:
        from tf_blocksparse import codec

        return codec
    except (ImportError, SyntaxError, NameError, AttributeError, TypeError, ValueError):
        # Package __init__ missing or mid-edit: load the module from its path.
        path = pathlib.Path(__file__).resolve().parents[1] / "tf_blocksparse" / "codec.py"
        spec = importlib.util.spec_from_file_location("_codec_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


codec = _load_codec()
SETTINGS = settings(max_examples=50, deadline=None)

_ELEMENTS = st.one_of(
    st.just(0.0),
    st.just(0.0),
    st.just(np.nan),
    st.floats(-1e6, 1e6, width=32, allow_nan=False),
)


def sparse_arrays(min_dims: int = 0, max_dims: int = 3):
    return hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64]),
        shape=hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=0, max_side=7),
        elements=_ELEMENTS,
    )


def _payload(length, starts, lengths, values, shape=None):
    return codec.RLEPayload(
        length=length,
        shape=(length,) if shape is None else shape,
        starts=np.asarray(starts, dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        values=np.asarray(values, dtype=np.float32),
    )


# ----------------------------------------------------------------- RLE round trips


@SETTINGS
@given(sparse_arrays())
def test_rle_round_trip(x):
    p = codec.rle_encode(x)
    p.validate()
    assert p.starts.dtype == np.int64 and p.lengths.dtype == np.int64
    assert p.values.dtype == x.dtype
    assert p.shape == x.shape and p.length == x.size
    # Runs are maximal: a gap of at least one zero separates consecutive runs.
    assert np.all(p.starts[1:] > p.starts[:-1] + p.lengths[:-1])
    y = codec.rle_decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize(
    "x",
    [
        np.zeros((3, 4), np.float32),
        np.ones(5, np.float32),
        np.zeros(0, np.float32),
        np.array(2.5, np.float64),
        np.array([np.nan, 0.0, np.nan, np.nan], np.float32),
    ],
    ids=["all_zero", "all_nonzero", "empty", "scalar", "nan"],
)
def test_rle_edge_cases(x):
    p = codec.rle_encode(x)
    np.testing.assert_array_equal(codec.rle_decode(p), x)
    assert p.values.size == np.count_nonzero(x != 0)


def test_rle_nan_is_data():
    p = codec.rle_encode(np.array([0.0, np.nan, np.nan, 0.0], np.float32))
    np.testing.assert_array_equal(p.starts, [1])
    np.testing.assert_array_equal(p.lengths, [2])
    assert np.isnan(p.values).all()


def test_rle_two_runs_hand_computed():
    x = np.array([0, 1, 2, 0, 0, 3, 0, 0], np.float32)
    p = codec.rle_encode(x)
    np.testing.assert_array_equal(p.starts, [1, 5])
    np.testing.assert_array_equal(p.lengths, [2, 1])
    np.testing.assert_array_equal(p.values, [1, 2, 3])
    # 4 header + 2 runs * (4 start + 4 length) + 3 float32 values.
    assert codec.rle_nbytes(p) == 4 + 16 + 12
    assert codec.rle_nbytes(codec.rle_encode(np.zeros(10, np.float64))) == 4
    assert codec.rle_nbytes(codec.rle_encode(np.ones(10, np.float64))) == 4 + 8 + 80


def test_rle_decode_accepts_adjacent_runs():
    p = _payload(5, [0, 2], [2, 2], [1, 2, 3, 4])
    np.testing.assert_array_equal(codec.rle_decode(p), [1, 2, 3, 4, 0])


# --------------------------------------------------------------- RLE malformed


@pytest.mark.parametrize(
    "starts, lengths, values, shape, field",
    [
        ([0, 1], [2, 1], [1, 2, 3], (6,), "starts"),  # overlapping runs
        ([3, 1], [1, 1], [1, 2], (6,), "starts"),  # not increasing
        ([1, 1], [1, 1], [1, 2], (6,), "starts"),  # repeated start
        ([6], [1], [1], (6,), "starts"),  # start out of range
        ([-1], [1], [1], (6,), "starts"),  # negative start
        ([4], [3], [1, 2, 3], (6,), "lengths"),  # run ends past length
        ([1, 3], [0, 1], [1], (6,), "lengths"),  # zero-length run
        ([1], [2], [1], (6,), "values"),  # values length != sum(lengths)
        ([1], [1, 1], [1], (6,), "lengths"),  # starts/lengths size mismatch
        ([1], [1], [1], (2, 2), "length"),  # length != prod(shape)
    ],
)
def test_rle_malformed(starts, lengths, values, shape, field):
    p = _payload(6, starts, lengths, values, shape)
    with pytest.raises(ValueError, match=f"`{field}`"):
        p.validate()
    with pytest.raises(ValueError, match=f"`{field}`"):
        codec.rle_decode(p)


@pytest.mark.parametrize("field", ["starts", "lengths"])
def test_rle_malformed_non_integer(field):
    p = _payload(6, [1], [1], [1])
    bad = {field: np.asarray(getattr(p, field), dtype=np.float32)}
    p = codec.RLEPayload(**{**p.__dict__, **bad})
    with pytest.raises(ValueError, match=f"`{field}`"):
        codec.rle_decode(p)


# ------------------------------------------------------------------ RLE in TF


def _check_tf_against_np(x, encode, decode):
    p = codec.rle_encode(x)
    starts, lengths, values = encode(tf.constant(x))
    assert starts.dtype == tf.int32 and lengths.dtype == tf.int32
    np.testing.assert_array_equal(starts.numpy(), p.starts)
    np.testing.assert_array_equal(lengths.numpy(), p.lengths)
    np.testing.assert_array_equal(values.numpy(), p.values)
    y = decode(starts, lengths, values, x.size)
    np.testing.assert_array_equal(y.numpy(), x)
    np.testing.assert_array_equal(decode(p.starts, p.lengths, p.values, x.size).numpy(), x)


_ENCODE_FN = tf.function(codec.rle_encode_tf, reduce_retracing=True)
_DECODE_FN = tf.function(codec.rle_decode_tf, reduce_retracing=True)


@SETTINGS
@given(sparse_arrays(min_dims=1, max_dims=1))
def test_rle_tf_matches_numpy_eager(x):
    _check_tf_against_np(x, codec.rle_encode_tf, codec.rle_decode_tf)


@SETTINGS
@given(sparse_arrays(min_dims=1, max_dims=1))
def test_rle_tf_matches_numpy_in_tf_function(x):
    _check_tf_against_np(x, _ENCODE_FN, _DECODE_FN)


def test_rle_tf_dynamic_shape_signature():
    spec = tf.TensorSpec([None], tf.float32)
    enc = tf.function(codec.rle_encode_tf, input_signature=[spec])
    for x in (np.zeros(4, np.float32), np.array([1, 0, 0, 2, 3, 0], np.float32)):
        s, n, v = enc(tf.constant(x))
        np.testing.assert_array_equal(codec.rle_decode_tf(s, n, v, x.size).numpy(), x)


# ----------------------------------------------------------------- block codec


@st.composite
def block_cases(draw):
    num_blocks = draw(st.integers(0, 12))
    block_size = draw(st.integers(1, 6))
    blocks = draw(
        hnp.arrays(np.float32, (num_blocks, block_size), elements=st.floats(-10, 10, width=32))
    )
    ids = draw(st.lists(st.integers(0, max(num_blocks - 1, 0)), unique=True, max_size=num_blocks))
    return blocks, np.asarray(ids, dtype=np.int64)


@SETTINGS
@given(block_cases())
def test_block_round_trip(case):
    blocks, ids = case
    p = codec.block_encode(blocks, ids)
    assert p.ids.dtype == np.int32 and p.values.shape == (ids.size, blocks.shape[1])
    out = codec.block_decode(p)
    assert out.shape == blocks.shape and out.dtype == blocks.dtype
    expected = np.zeros_like(blocks)
    expected[ids] = blocks[ids]
    np.testing.assert_array_equal(out, expected)
    assert codec.block_nbytes(p) == 4 * ids.size + 4 * ids.size * blocks.shape[1]


def test_block_nbytes_hand_computed():
    blocks = np.arange(20, dtype=np.float32).reshape(5, 4)
    p = codec.block_encode(blocks, [3, 0])
    np.testing.assert_array_equal(p.values, blocks[[3, 0]])
    assert codec.block_nbytes(p) == 2 * 4 + 2 * 4 * 4
    assert codec.dense_nbytes((5, 4), np.float32) == 80
    assert codec.dense_nbytes((5, 4), tf.float16) == 40
    assert codec.dense_nbytes((), "float64") == 8


def _block(ids, values=None, num_blocks=4, block_size=2):
    ids = np.asarray(ids)
    if values is None:
        values = np.ones((ids.size, block_size), np.float32)
    return codec.BlockPayload(num_blocks, block_size, ids, np.asarray(values))


@pytest.mark.parametrize(
    "payload, field",
    [
        (_block(np.array([1, 1], np.int32)), "ids"),  # duplicated
        (_block(np.array([4], np.int32)), "ids"),  # out of range
        (_block(np.array([-1], np.int32)), "ids"),  # negative
        (_block(np.array([1.0], np.float32)), "ids"),  # non-integer
        (_block(np.array([1, 2], np.int32), np.ones((2, 3), np.float32)), "values"),
        (_block(np.array([1, 2], np.int32), np.ones((1, 2), np.float32)), "values"),
        (_block(np.array([1, 2], np.int32), np.ones(4, np.float32)), "values"),
    ],
)
def test_block_malformed(payload, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        payload.validate()
    with pytest.raises(ValueError, match=f"`{field}`"):
        codec.block_decode(payload)


@pytest.mark.parametrize("ids", [[1, 1], [5], [0.0, 1.0], [[0, 1]]])
def test_block_encode_rejects_bad_ids(ids):
    with pytest.raises(ValueError, match="`ids`"):
        codec.block_encode(np.zeros((4, 2), np.float32), np.asarray(ids))


def test_block_encode_rejects_non_matrix():
    with pytest.raises(ValueError, match="`blocks`"):
        codec.block_encode(np.zeros(8, np.float32), [0])


# ---------------------------------------------------------------- pack/unpack

_shape_lists = st.lists(
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), min_size=1, max_size=4
)


@SETTINGS
@given(_shape_lists, st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(shapes, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    total = sum(a.size for a in arrays)
    buf_np = codec.pack_np(arrays)
    assert buf_np.shape == (total,)
    buf_tf = codec.pack([tf.constant(a) for a in arrays])
    assert buf_tf.shape == (total,)
    np.testing.assert_array_equal(buf_tf.numpy(), buf_np)
    assert codec.buffer_nbytes(buf_tf) == 4 * total
    for out in (codec.unpack_np(buf_np, shapes), codec.unpack(buf_tf, shapes)):
        assert len(out) == len(arrays)
        for got, want in zip(out, arrays):
            assert tuple(got.shape) == want.shape
            np.testing.assert_array_equal(np.asarray(got), want)


def test_pack_unpack_in_tf_function():
    shapes = [(2, 3), (4,), ()]

    @tf.function
    def round_trip(a, b, c):
        buf = codec.pack([a, b, c])
        assert buf.shape == (11,)
        return codec.unpack(buf, shapes)

    arrays = [np.arange(np.prod(s), dtype=np.float32).reshape(s) + 1 for s in shapes]
    for got, want in zip(round_trip(*arrays), arrays):
        np.testing.assert_array_equal(got.numpy(), want)


def test_pack_single_tensor_is_flattened():
    buf = codec.pack([tf.ones((2, 2), tf.int32)])
    assert buf.shape == (4,) and buf.dtype == tf.int32


def test_pack_rejects_empty_and_mixed():
    with pytest.raises(ValueError, match="`tensors`"):
        codec.pack([])
    with pytest.raises(ValueError, match="`tensors`"):
        codec.pack([tf.ones(2, tf.float32), tf.ones(2, tf.int32)])


def test_unpack_size_mismatch():
    with pytest.raises(ValueError, match="`buffer`"):
        codec.unpack(tf.zeros(5), [(2, 2)])
    with pytest.raises(ValueError, match="`buffer`"):
        codec.unpack(tf.zeros(5), [(2,), (2,)])
    with pytest.raises(ValueError, match="`buffer`"):
        codec.unpack_np(np.zeros(3), [(2, 2)])

    @tf.function
    def traced(buf):
        return codec.unpack(buf, [(2, 3)])

    with pytest.raises(ValueError, match="`buffer`"):
        traced(tf.zeros(7))


def test_buffer_nbytes():
    assert codec.buffer_nbytes(tf.zeros((3, 5), tf.float16)) == 30
    assert codec.buffer_nbytes(tf.zeros((7,), tf.int32)) == 28

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def dynamic(t):
        return codec.buffer_nbytes(t)

    with pytest.raises(ValueError, match="`t`"):
        dynamic.get_concrete_function()
