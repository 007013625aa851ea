"""Tests for tf_blocksparse.extras.run_length, the run-length codec the notebooks use."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tf_blocksparse.extras import run_length

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
    return run_length.RLEPayload(
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
    p = run_length.rle_encode(x)
    p.validate()
    assert p.starts.dtype == np.int64 and p.lengths.dtype == np.int64
    assert p.values.dtype == x.dtype
    assert p.shape == x.shape and p.length == x.size
    # Runs are maximal: a gap of at least one zero separates consecutive runs.
    assert np.all(p.starts[1:] > p.starts[:-1] + p.lengths[:-1])
    y = run_length.rle_decode(p)
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
    p = run_length.rle_encode(x)
    np.testing.assert_array_equal(run_length.rle_decode(p), x)
    assert p.values.size == np.count_nonzero(x != 0)


def test_rle_nan_is_data():
    p = run_length.rle_encode(np.array([0.0, np.nan, np.nan, 0.0], np.float32))
    np.testing.assert_array_equal(p.starts, [1])
    np.testing.assert_array_equal(p.lengths, [2])
    assert np.isnan(p.values).all()


def test_rle_two_runs_hand_computed():
    x = np.array([0, 1, 2, 0, 0, 3, 0, 0], np.float32)
    p = run_length.rle_encode(x)
    np.testing.assert_array_equal(p.starts, [1, 5])
    np.testing.assert_array_equal(p.lengths, [2, 1])
    np.testing.assert_array_equal(p.values, [1, 2, 3])
    # 4 header + 2 runs * (4 start + 4 length) + 3 float32 values.
    assert run_length.rle_nbytes(p) == 4 + 16 + 12
    assert run_length.rle_nbytes(run_length.rle_encode(np.zeros(10, np.float64))) == 4
    assert run_length.rle_nbytes(run_length.rle_encode(np.ones(10, np.float64))) == 4 + 8 + 80


def test_rle_decode_accepts_adjacent_runs():
    p = _payload(5, [0, 2], [2, 2], [1, 2, 3, 4])
    np.testing.assert_array_equal(run_length.rle_decode(p), [1, 2, 3, 4, 0])


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
        run_length.rle_decode(p)


@pytest.mark.parametrize("field", ["starts", "lengths"])
def test_rle_malformed_non_integer(field):
    p = _payload(6, [1], [1], [1])
    bad = {field: np.asarray(getattr(p, field), dtype=np.float32)}
    p = run_length.RLEPayload(**{**p.__dict__, **bad})
    with pytest.raises(ValueError, match=f"`{field}`"):
        run_length.rle_decode(p)


# ------------------------------------------------------------------ RLE in TF


def _check_tf_against_np(x, encode, decode):
    p = run_length.rle_encode(x)
    starts, lengths, values = encode(tf.constant(x))
    assert starts.dtype == tf.int32 and lengths.dtype == tf.int32
    np.testing.assert_array_equal(starts.numpy(), p.starts)
    np.testing.assert_array_equal(lengths.numpy(), p.lengths)
    np.testing.assert_array_equal(values.numpy(), p.values)
    y = decode(starts, lengths, values, x.size)
    np.testing.assert_array_equal(y.numpy(), x)
    np.testing.assert_array_equal(decode(p.starts, p.lengths, p.values, x.size).numpy(), x)


_ENCODE_FN = tf.function(run_length.rle_encode_tf, reduce_retracing=True)
_DECODE_FN = tf.function(run_length.rle_decode_tf, reduce_retracing=True)


@SETTINGS
@given(sparse_arrays(min_dims=1, max_dims=1))
def test_rle_tf_matches_numpy_eager(x):
    _check_tf_against_np(x, run_length.rle_encode_tf, run_length.rle_decode_tf)


@SETTINGS
@given(sparse_arrays(min_dims=1, max_dims=1))
def test_rle_tf_matches_numpy_in_tf_function(x):
    _check_tf_against_np(x, _ENCODE_FN, _DECODE_FN)


def test_rle_tf_dynamic_shape_signature():
    spec = tf.TensorSpec([None], tf.float32)
    enc = tf.function(run_length.rle_encode_tf, input_signature=[spec])
    for x in (np.zeros(4, np.float32), np.array([1, 0, 0, 2, 3, 0], np.float32)):
        s, n, v = enc(tf.constant(x))
        np.testing.assert_array_equal(run_length.rle_decode_tf(s, n, v, x.size).numpy(), x)
