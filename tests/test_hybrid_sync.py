"""The hybrid trainer's group sync takes the one options object: a dict spec and its
``CompressionOptions`` train identically, and the other exchange mode works there too."""

import keras
import numpy as np
import pytest

import tf_blocksparse as tfbs
from tf_blocksparse.hybrid.sync import check_compression
from tf_blocksparse.hybrid.trainer import HybridTrainer

CPUS = ["/cpu:0", "/cpu:1"]


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3, name="c"),
                             keras.layers.Flatten(), keras.layers.Dense(8, name="d1"),
                             keras.layers.Dense(3, name="d2")])


def _train(compression, steps: int = 2) -> tuple[HybridTrainer, list]:
    rng = np.random.default_rng(5)
    trainer = HybridTrainer(_model(), CPUS, CPUS, keras.optimizers.SGD(0.05),
                            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            compression=compression)
    for _ in range(steps):
        trainer.train_step(rng.standard_normal((8, 6, 6, 1)).astype("float32"),
                           rng.integers(0, 3, 8).astype("int32"))
    trainer.copy_to_model()
    return trainer, trainer.model.get_weights()


def test_dict_spec_and_options_object_train_identically():
    spec, w_spec = _train({"k": 1, "metric": "l2"})
    opts, w_opts = _train(tfbs.CompressionOptions(k=1, metric="l2", exchange="allgather",
                                                  dense_below=0))
    for a, b in zip(w_spec, w_opts):
        np.testing.assert_array_equal(a, b)
    assert spec.syncs["fc"].options == opts.syncs["fc"].options
    assert spec.syncs["fc"].nbytes() == opts.syncs["fc"].nbytes()


def test_shared_exchange_and_dense_options_in_the_groups():
    shared, w_shared = _train(tfbs.CompressionOptions(k=1, exchange="shared", dense_below=0))
    _, w_allgather = _train(tfbs.CompressionOptions(k=1, exchange="allgather", dense_below=0))
    _, w_dense = _train(None)
    assert any(not np.array_equal(a, b) for a, b in zip(w_shared, w_allgather))
    assert any(not np.array_equal(a, b) for a, b in zip(w_shared, w_dense))
    res = shared.syncs["fc"].residuals
    # the replicas agreed on the blocks: where one kept a block, so did the other
    kernel = [r[0].numpy() for r in res]
    assert np.array_equal(kernel[0] == 0, kernel[1] == 0) and np.any(kernel[0])
    dense, w_opt_dense = _train(tfbs.CompressionOptions(exchange="dense"))
    assert dense.syncs["conv"].options is None and not dense.syncs["conv"].residuals
    for a, b in zip(w_opt_dense, w_dense):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec, match", [({"k": 0}, "compression: `k`"),
                                         ({"metric": "l3"}, "compression: `metric`"),
                                         ({"exchange": "shared"}, "keys k, density, metric"),
                                         ("k=1", "tfbs.CompressionOptions")])
def test_bad_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        check_compression(spec, "compression")


def test_the_options_default_auto_is_named_in_a_group():
    """``CompressionOptions``' default exchange is the optimizer wrapper's measured "auto";
    a group sync cannot measure, so it says so at construction."""
    with pytest.raises(ValueError, match="exchange='auto' \\(the CompressionOptions default"):
        _train(tfbs.CompressionOptions(k=1), steps=0)
