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
