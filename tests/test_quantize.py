"""Quantised block values (``quantize=``): NumPy references of the codes, properties of the
round trip, and the all-gather exchange on 2 real replicas (nothing lost: the quantisation
error stays in the residuals; bytes counted from the real buffers)."""

import functools
import math
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tf_blocksparse as tfbs
from tests.test_optimizer_reference import _read_only
from tf_blocksparse import quantize


def _bfloat16_np(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16, back in float32 (finite values)."""
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _int_np(v: np.ndarray, levels: int) -> np.ndarray:
    top = np.max(np.abs(v), axis=1)
    scale = np.where(top > 0, top / np.float32(levels), np.float32(1)).astype(np.float32)
    q = np.clip(np.round(v / scale[:, None]), -levels, levels).astype(np.float32)
    return q * scale[:, None]


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "int4"])
def test_codes_match_a_numpy_reference_and_decode_exactly(mode):
    rng = np.random.default_rng(1)
    v = (rng.standard_normal((5, 7)) * np.array([1e-3, 1, 10, 0, 1e4])[:, None]).astype(
        np.float32)
    words, sent = quantize.encode(tf.constant(v), mode)
    want = _bfloat16_np(v) if mode == "bfloat16" else _int_np(v, {"int8": 127, "int4": 7}[mode])
    np.testing.assert_array_equal(sent.numpy(), want)
    assert words.dtype == tf.int32 and words.shape == (quantize.num_words(5, 7, mode),)
    two = tf.stack([words, words])  # two replicas sent the same
    got = quantize.decode(two, 5, 7, mode).numpy()
    np.testing.assert_array_equal(got, np.concatenate([want, want]))
    assert np.all(want[3] == 0)  # an all-zero block stays zero


@pytest.mark.parametrize("mode,bits", [("bfloat16", 16), ("int8", 8), ("int4", 4)])
def test_bytes_per_block(mode, bits):
    scales = 0 if mode == "bfloat16" else 4 * 3
    assert quantize.value_nbytes(3, 10, mode, 4) == scales + 4 * math.ceil(30 * bits / 32)
    assert quantize.value_nbytes(3, 10, "none", 4) == 120


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 9)),
                  elements=st.floats(-1e6, 1e6, width=32)),
       st.sampled_from(["int8", "int4"]))
@example(np.array([[0.0, 1.1754944e-38]], np.float32), "int8")  # scale would be subnormal
@example(np.array([[3e-39, -1e-45, 0.0]], np.float32), "int4")
@example(np.array([[9.469735e-39]], np.float32), "int8")  # a subnormal input, flushed to 0
def test_integer_codes_err_by_at_most_half_a_step(v, mode):
    levels = {"int8": 127, "int4": 7}[mode]
    words, sent = quantize.encode(tf.constant(v), mode)
    tiny = np.finfo(np.float32).tiny  # the least scale: CPU kernels flush subnormals
    scale = np.maximum(np.max(np.abs(v), axis=1, keepdims=True) / levels, tiny)
    sent = sent.numpy()
    assert np.all(np.isfinite(sent))
    # Within half a step, except a subnormal input that the CPU's arithmetic reads as zero.
    flushed = (np.abs(v) < tiny) & (sent == 0)
    assert np.all((np.abs(sent - v) <= scale / 2 * (1 + 1e-5)) | flushed)
    np.testing.assert_array_equal(
        quantize.decode(words[None], v.shape[0], v.shape[1], mode).numpy(), sent)


def _step(strategy, quantize_mode, sync_every=None, exchange="allgather"):
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32),
                                  keras.layers.Dense(4)])
        extra = {} if sync_every is None else {"sync_every": sync_every,
                                               "outer": keras.optimizers.SGD(1.0)}
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(1.0), density=0.25,
                                        dense_below=0, exchange=exchange,
                                        quantize=quantize_mode, **extra)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    w0 = [v.numpy() for v in variables]
    rng = np.random.default_rng(5)
    grads = [[rng.standard_normal(v.shape).astype("float32") for v in variables]
             for _ in range(2)]

    @tf.function
    def step(g):
        strategy.run(lambda g: opt.apply(list(g), variables), args=(g,))

    step(strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(tf.constant(g) for g in grads[ctx.replica_id_in_sync_group])))
    return w0, [v.numpy() for v in variables], opt, grads


class _Outcome(NamedTuple):
    """What one :func:`_step` left, as read-only NumPy arrays and numbers."""

    w0: tuple  # the weights before the step
    w1: tuple  # and after it
    residuals: tuple  # per variable, the sum over replicas
    grads: tuple  # [replica][variable]
    payload_bytes: float
    counts: tuple  # per variable, the blocks each replica sends
    sizes: tuple  # per variable, the block size


def _outcome(strategy, quantize_mode, sync_every=None, exchange="allgather") -> _Outcome:
    """:func:`_step`'s result, computed once per module and argument set."""
    return _outcome_once(strategy, quantize_mode, sync_every, exchange)


@functools.cache
def _outcome_once(strategy, quantize_mode, sync_every, exchange) -> _Outcome:
    w0, w1, opt, grads = _step(strategy, quantize_mode, sync_every, exchange)
    return _Outcome(_read_only(w0), _read_only(w1),
                    _read_only(r.numpy() for r in opt.residuals),
                    tuple(_read_only(g) for g in grads),
                    opt.block_sparse_metrics()["payload_bytes"],
                    tuple(opt._compressor([i]).counts[0] for i in range(len(w0))),
                    tuple(lay.block_size for lay in opt.layouts))


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "int4"])
def test_the_quantisation_error_stays_in_the_residuals(mirrored2, mode):
    """One step from zero residuals with SGD(1.0): the weights moved by what was sent, and
    what was sent plus every replica's residual is the replicas' whole gradient."""
    run = _outcome(mirrored2, mode)
    for a, b, k, g0, g1 in zip(run.w0, run.w1, run.residuals, *run.grads):
        np.testing.assert_allclose(a - b + k, g0 + g1, rtol=1e-5, atol=1e-5)
    plain = _outcome(mirrored2, "none")
    moved = sum(np.sum(np.abs(a - b)) for a, b in zip(run.w0, run.w1))
    assert moved > 0 and not all(np.array_equal(a, b) for a, b in zip(run.w1, plain.w1))
    # bytes from the real buffer: ids + flag + (scales +) codes, all int32 words
    got, want = run.payload_bytes, plain.payload_bytes
    counts, sizes = run.counts, run.sizes
    assert got == 4 * (sum(counts) + 1) + sum(quantize.value_nbytes(k, bs, mode, 4)
                                              for k, bs in zip(counts, sizes))
    assert want == 4 * (sum(counts) + 1) + sum(4 * k * bs for k, bs in zip(counts, sizes))
    assert got < want


def test_quantised_local_steps(mirrored2):
    w0, w1, opt, grads = _step(mirrored2, "int8", sync_every=1)
    kept = [r.numpy() for r in opt.residuals]
    for a, b, k, g0, g1 in zip(w0, w1, kept, *grads):  # inner and outer SGD(1.0)
        np.testing.assert_allclose(a - b + k, g0 + g1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sync_every", [None, 2])
def test_the_automatic_exchange_sends_quantised_values_in_its_allgather_groups(mirrored2,
                                                                              sync_every):
    """``quantize`` under the automatic exchange: a group in ``"allgather"`` is the
    quantised all-gather exchange bit for bit (weights, residuals, bytes), per step and
    with local steps; a group in ``"dense"`` sends the plain sum, unquantised."""
    def run(mode, exchange):
        out = _outcome(mirrored2, mode, sync_every, exchange)
        return out.w1, out.residuals, out.payload_bytes

    pinned = tfbs.AutoExchange(candidates=("allgather",))
    for (a, ra, ma), (b, rb, mb) in [(run("int8", pinned), run("int8", "allgather")),
                                     (run("int8", tfbs.AutoExchange(candidates=("dense",))),
                                      run("none", "dense"))]:
        assert len(a + ra) == len(b + rb)
        for x, y in zip(a + ra, b + rb):
            np.testing.assert_array_equal(x, y)
        assert ma == mb


def test_quantize_narrows_the_automatic_exchange_to_the_modes_that_carry_codes():
    opts = tfbs.CompressionOptions(density=0.05, quantize="int8")  # exchange="auto"
    assert opts.auto and opts.exchange.candidates == ("dense", "allgather")
    assert tfbs.CompressionOptions.from_config(opts.get_config()) == opts
    policy = tfbs.AutoExchange(candidates=("allgather", "dense"), warmup_steps=3)
    assert tfbs.CompressionOptions(quantize="bfloat16", exchange=policy).exchange == policy
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), density=0.05, quantize="int4")
    assert opt.compression.exchange.candidates == ("dense", "allgather")


@pytest.mark.parametrize("kwargs,named", [
    ({"quantize": "int3", "exchange": "allgather"}, "quantize"),
    ({"quantize": "int8", "exchange": "shared"}, "allgather"),
    ({"quantize": "int8", "exchange": tfbs.AutoExchange(candidates=("shared",))},
     "candidates"),
    ({"quantize": "int8", "exchange": "allgather", "granularity": "element",
      "density": 0.1}, "granularity"),
])
def test_bad_quantize_options_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        tfbs.CompressionOptions(**kwargs)


def test_config_round_trip_keeps_quantize_and_leaves_old_configs_alone():
    opts = tfbs.CompressionOptions(exchange="allgather", quantize="int4")
    assert tfbs.CompressionOptions.from_config(opts.get_config()) == opts
    assert "quantize" not in tfbs.CompressionOptions(exchange="allgather").get_config()
