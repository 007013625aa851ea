"""The one-line default: the automatic exchange, momentum moved before a sparse exchange,
small variables whole; files saved before these defaults keep the behaviour they were saved
with."""

import functools
import os

import keras
import numpy as np
import pytest

import tf_blocksparse as tfbs
from tests.batches import fit_in_order
from tests.versions import reads_keras_315_files
from tf_blocksparse.keras.optimizer_args import DENSE_BELOW

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def test_the_default_is_the_automatic_exchange():
    """Sparse groups keep the momentum per replica (moved before the exchange), dense ones in
    the inner SGD, which keeps it for them."""
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    assert opt.compression.auto and opt.exchange == tfbs.AutoExchange()
    assert opt.momentum_correction == pytest.approx(0.9)
    assert opt.inner_optimizer.momentum == pytest.approx(0.9)
    assert opt.dense_below == DENSE_BELOW == 1024 and opt.k == 1
    assert opt.momentum_masking == "whole"


def test_inner_sgd_momentum_moves_before_a_sparse_exchange():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                    exchange="allgather")
    assert opt.momentum_correction == pytest.approx(0.9)
    assert opt.inner_optimizer.momentum == 0.0
    assert opt.dense_below == DENSE_BELOW == 1024 and opt.k == 1
    assert opt.momentum_masking == "whole"


@pytest.mark.parametrize("inner,exchange", [
    (lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), "allgather"),
    (lambda: keras.optimizers.SGD(0.05, momentum=0.9), "dense"),
    (lambda: keras.optimizers.Adam(1e-3), "shared"),
    (lambda: keras.optimizers.SGD(0.05), "allgather"),
])
def test_nothing_moves_where_it_would_not_be_the_same_method(inner, exchange):
    opt = tfbs.BlockSparseOptimizer(inner(), exchange=exchange)
    assert opt.momentum_correction is None


def test_global_momentum_stays_available():
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                    momentum_correction=None, dense_below=0)
    assert opt.momentum_correction is None and opt.inner_optimizer.momentum == 0.9
    again = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert again.momentum_correction is None and again.inner_optimizer.momentum == 0.9


def test_a_failed_check_leaves_the_inner_optimizer_alone():
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    with pytest.raises(ValueError, match="`metric`"):
        tfbs.BlockSparseOptimizer(inner, metric="l3")
    assert inner.momentum == 0.9


@pytest.mark.parametrize("exchange,inner_momentum", [(None, 0.9), ("allgather", 0.0)])
def test_config_round_trip_keeps_the_resolved_default(exchange, inner_momentum):
    kwargs = {} if exchange is None else {"exchange": exchange}
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **kwargs)
    again = tfbs.BlockSparseOptimizer.from_config(opt.get_config())
    assert again.compression == opt.compression
    assert again.momentum_correction == pytest.approx(0.9)
    assert again.inner_optimizer.momentum == pytest.approx(inner_momentum)
    assert again.dense_below == 1024


def _flat_config(**changes):
    """A config in the flat layout files were written with before CompressionOptions."""
    config = {"name": "block_sparse_optimizer",
              "inner": keras.saving.serialize_keras_object(
                  keras.optimizers.SGD(0.05, momentum=0.9)),
              "k": 1, "density": None, "metric": "l1", "exchange": "allgather",
              "nonfinite": "skip", "block_rules": {}, "granularity": "block",
              "fusion_buffer_bytes": None, "clipping": [], "momentum_correction": None,
              "dense_below": 0, "momentum_masking": "all"}
    config.update(changes)
    return config


def test_config_without_the_new_keys_means_the_old_behaviour():
    config = _flat_config()
    del config["momentum_correction"], config["dense_below"]
    old = tfbs.BlockSparseOptimizer.from_config(config)
    assert old.momentum_correction is None and old.inner_optimizer.momentum == 0.9
    assert old.dense_below == 0


def test_a_config_without_a_masking_keeps_dgc_masking():
    """Configs written before the masking was a choice keep DGC's ``"all"`` (what they were
    saved with), in the composed layout and the flat one; a new optimizer gets ``"whole"``."""
    assert tfbs.MomentumCorrection.from_config({"momentum": 0.9}).masking == "all"
    flat = _flat_config(inner=keras.saving.serialize_keras_object(keras.optimizers.SGD(0.05)),
                        momentum_correction=0.9)
    del flat["momentum_masking"]
    old = tfbs.BlockSparseOptimizer.from_config(flat)
    assert old.momentum_correction == 0.9 and old.momentum_masking == "all"
    composed = old.get_config()
    assert composed["momentum_correction"] == {"momentum": 0.9, "masking": "all"}
    assert tfbs.BlockSparseOptimizer.from_config(composed).momentum_masking == "all"
    del composed["momentum_correction"]["masking"]
    assert tfbs.BlockSparseOptimizer.from_config(composed).momentum_masking == "all"


@pytest.mark.parametrize("saved, masking", [(True, "all"), (False, "none")])
def test_a_flat_config_with_an_on_off_masking_keeps_it(saved, masking):
    """Flat configs written when the masking was a bool load with the masking they ran:
    on was DGC's ``"all"``, off kept the momentum whole (``"none"``)."""
    flat = _flat_config(inner=keras.saving.serialize_keras_object(keras.optimizers.SGD(0.05)),
                        momentum_correction=0.9, momentum_masking=saved)
    old = tfbs.BlockSparseOptimizer.from_config(flat)
    assert old.momentum_masking == masking
    assert old.get_config()["momentum_correction"] == {"momentum": 0.9, "masking": masking}


def test_flat_config_round_trips_into_the_composed_form():
    old = tfbs.BlockSparseOptimizer.from_config(_flat_config(
        inner=keras.saving.serialize_keras_object(keras.optimizers.SGD(0.05)), k=None,
        density=0.25, metric="l2", exchange="shared", block_rules={"dense": "single"},
        momentum_correction=0.5, momentum_masking="waited", dense_below=7))
    assert old.momentum_correction == 0.5 and old.momentum_masking == "waited"
    assert old.compression == tfbs.CompressionOptions(
        density=0.25, metric="l2", exchange="shared", block_rules={"dense": "single"},
        dense_below=7)
    assert old.momentum_policy == tfbs.MomentumCorrection(0.5, masking="waited")
    again = tfbs.BlockSparseOptimizer.from_config(old.get_config())
    assert again.get_config() == old.get_config()


@reads_keras_315_files
def test_model_saved_by_version_0_1_0_loads_with_its_behaviour():
    model = keras.saving.load_model(os.path.join(DATA, "model_v0_1_0.keras"))
    opt = model.optimizer
    assert isinstance(opt, tfbs.BlockSparseOptimizer)
    assert opt.momentum_correction is None and opt.inner_optimizer.momentum == 0.9
    assert opt.dense_below == 0 and opt.k == 1
    saved = np.load(os.path.join(DATA, "model_v0_1_0_residuals.npz"))
    for r, key in zip(opt.residuals, saved.files):
        np.testing.assert_array_equal(r.numpy(), saved[key])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 6, 6, 1)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, rng.integers(0, 3, 8), batch_size=8, epochs=1, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def _train_conv(strategy, make_opt):
    """The weights after 2 epochs (8 steps) of a small conv net trained with ``make_opt()``;
    an automatic exchange's decision is forced sparse (``allgather``), so two runs cannot
    decide differently (8 steps: before its first re-decision)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 3, 64)
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(40, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
        opt = make_opt()
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        opt.build(model.trainable_variables)
    if opt.exchange_chooser is not None:
        opt.exchange_chooser.set_modes(["allgather"] * len(opt.exchange_chooser.modes))
    fit_in_order(model, x, y, 16, 2)
    return model.get_weights()


@functools.cache
def _literal_weights(strategy):
    """:func:`_train_conv` with the literal form (global momentum, nothing sent whole), once
    per module."""
    return _train_conv(strategy, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), momentum_correction=None, dense_below=0,
        exchange="allgather"))


@pytest.mark.parametrize("exchange", ["auto", "allgather"])
def test_default_equals_its_explicit_form(mirrored2, exchange):
    """The keyword defaults spelt out train the same weights bit for bit, and differ from
    the literal form."""
    default_kwargs = {} if exchange == "auto" else {"exchange": exchange}
    default = _train_conv(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), **default_kwargs))
    explicit = _train_conv(mirrored2, lambda: tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.05), momentum_correction=0.9, dense_below=1024,
        exchange=exchange))
    for a, b in zip(default, explicit):
        np.testing.assert_array_equal(a, b)
    literal = _literal_weights(mirrored2)
    assert any(not np.allclose(a, b) for a, b in zip(default, literal))
