"""A selection that keeps every block (``density=1.0``, or a ``k`` at least every block count)
sends the plain dense all-reduce: dense's bytes and dense's weights, on 2 real replicas."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order
from tf_blocksparse import blocks
from tf_blocksparse.exchange_bytes import dense_nbytes, group_cost, selection_nbytes
from tf_blocksparse.feedback import BlockTopK


def _layouts():
    return [blocks.rule_for("d/kernel", (6, 4)), blocks.rule_for("d/bias", (4,))]


@pytest.mark.parametrize("kwargs,keeps_all", [
    ({"density": 1.0}, True), ({"k": 10**6}, True), ({"k": 1, "dense_below": 10**6}, True),
    ({"density": 0.5}, False), ({"k": 1}, False)])
def test_keeps_all_and_its_bytes(kwargs, keeps_all):
    comp = BlockTopK(_layouts(), **{"dense_below": 0, **kwargs})
    assert comp.keeps_all == keeps_all
    dense = dense_nbytes([tf.zeros((6, 4)), tf.zeros((4,))])
    cost = group_cost(comp, ["float32", "float32"])
    if keeps_all:
        assert selection_nbytes(comp, ["float32", "float32"]) == dense == 4 * 28
        assert (cost.whole_bytes, cost.id_bytes, cost.value_bytes, cost.score_bytes) == (
            dense, 0, 0, 0)
    else:
        assert selection_nbytes(comp, ["float32", "float32"]) < dense
        assert cost.value_bytes > 0


def test_density_one_keeps_every_block_and_auto_momentum_stays_inside():
    assert tfbs.CompressionOptions(density=1.0).keeps_every_block
    assert not tfbs.CompressionOptions(density=0.99).keeps_every_block
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), density=1.0,
                                    exchange="allgather")
    assert opt.momentum_correction is None and opt.inner_optimizer.momentum == 0.9


def _fit(strategy, **opt_kwargs):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 3, 64)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(8, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                        **opt_kwargs)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    fit_in_order(model, x, y, 16, 2)
    return model.get_weights(), opt.block_sparse_metrics()


@functools.cache
def _dense(strategy):
    """``exchange="dense"``'s weights and figures (trained once per module)."""
    return _fit(strategy, exchange="dense")


@pytest.mark.parametrize("exchange,kwargs", [
    ("allgather", {"density": 1.0}), ("shared", {"density": 1.0}),
    ("allgather", {"k": 10**6, "momentum_correction": None, "dense_below": 0})])
def test_keeping_every_block_is_the_dense_exchange(mirrored2, exchange, kwargs):
    """Dense's bytes per step and dense's weights bit for bit; the default momentum stays in
    the inner SGD at density 1.0, as with ``exchange="dense"``."""
    dense_w, dense_m = _dense(mirrored2)
    got_w, got_m = _fit(mirrored2, exchange=exchange, **kwargs)
    for a, b in zip(got_w, dense_w):
        np.testing.assert_array_equal(a, b)
    assert got_m["payload_bytes"] == got_m["dense_bytes"] == dense_m["payload_bytes"] == \
        4 * (72 + 8 + 128 * 3 + 3)
    assert got_m["residual_norm"] == 0.0
