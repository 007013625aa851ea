"""``CompressionOptions.embeddings``: small embedding tables compressed (the default) or sent
whole under ``dense_below`` (``"by_size"``), on 2 real replicas against the NumPy reference,
and in saved configs."""

import functools

import keras
import numpy as np
import pytest

import tf_blocksparse as tfbs
from tests import reference as ref
from tests.test_optimizer_reference import LR, STEPS, _replica_grads, _run_distributed

VOCAB, DIM, LENGTH = 12, 4, 5
#: Above the 48-element table, below the 60-element kernel: only the table's rule differs.
DENSE_BELOW = 50


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                             keras.layers.Embedding(VOCAB, DIM, name="emb"),
                             keras.layers.Flatten(), keras.layers.Dense(3, name="fc")])


def _data(step: int, replica: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 * step + replica)
    return (rng.integers(0, VOCAB, (4, LENGTH)).astype("int32"),
            rng.standard_normal((4, 3)).astype("float32"))


@functools.cache
def _grad_model() -> keras.Model:
    return _model()


def _run(strategy, **opt_kwargs):
    return _run_distributed(strategy, inner_momentum=0.0, model_fn=_model, data_fn=_data,
                            k=1, exchange="allgather", dense_below=DENSE_BELOW, **opt_kwargs)


def _reference(n, layouts, start, embeddings):
    weights = [np.array(w) for w in start]
    residuals = [[np.zeros_like(w) for w in weights] for _ in range(n)]
    for s in range(STEPS):
        grads = [_replica_grads(weights, *_data(s, r), n, _grad_model()) for r in range(n)]
        updates, residuals, finite = ref.np_step("allgather", grads, residuals, layouts, k=1,
                                                 dense_below=DENSE_BELOW,
                                                 embeddings=embeddings)
        assert finite
        weights = [w - np.float32(LR) * u for w, u in zip(weights, updates)]
    return weights, residuals


@pytest.mark.parametrize("embeddings", ["compress", "by_size"])
def test_small_embedding_table_matches_numpy_reference(mirrored2, embeddings):
    """The 48-element table under ``dense_below=50``: one row per replica and step with
    ``"compress"`` (the rest held back in the residual), the whole table with ``"by_size"``;
    weights, residuals and bytes as the NumPy reference has them."""
    kwargs = {} if embeddings == "compress" else {"embeddings": embeddings}
    model, opt = _run(mirrored2, **kwargs)
    start_model = _model()
    layouts = tfbs.blocks.layouts_for(start_model.trainable_variables, start_model)
    assert [lay.embedding for lay in layouts] == [True, False, False]
    start = [w.numpy() for w in start_model.trainable_variables]
    want_w, want_r = _reference(2, layouts, start, embeddings)
    for v, want in zip(model.trainable_variables, want_w):
        np.testing.assert_allclose(v.value.values[0].numpy(), want, rtol=1e-5, atol=1e-6)
    for r in range(2):
        for res, want in zip(opt.residuals, want_r[r]):
            np.testing.assert_allclose(res.value.values[r].numpy(), want, rtol=1e-5, atol=1e-6)
    table_held = [float(np.abs(opt.residuals[0].value.values[r].numpy()).sum()) for r in range(2)]
    assert all(h > 0 for h in table_held) == (embeddings == "compress"), table_held
    assert all(h == 0 for h in table_held) == (embeddings == "by_size"), table_held
    m = opt.block_sparse_metrics()
    assert m["payload_bytes"] == ref.np_payload_bytes("allgather", layouts, k=1,
                                                      dense_below=DENSE_BELOW,
                                                      embeddings=embeddings)
    assert opt.get_config()["compression"]["embeddings"] == embeddings


def test_saved_configs_without_the_rule_keep_small_tables_whole():
    """A config saved before the rule existed names none and meant ``"by_size"``; a config
    saved now names its rule and round-trips."""
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), exchange="allgather")
    config = opt.get_config()
    assert config["compression"]["embeddings"] == "compress"
    assert tfbs.BlockSparseOptimizer.from_config(config).compression.embeddings == "compress"
    old = dict(config, compression={k: v for k, v in config["compression"].items()
                                    if k != "embeddings"})
    assert tfbs.BlockSparseOptimizer.from_config(old).compression.embeddings == "by_size"
    # the options themselves default to the library's rule
    assert tfbs.CompressionOptions.from_config({"k": 1}).embeddings == "compress"


@pytest.mark.parametrize("bad", ["whole", "", None, True])
def test_bad_embeddings_value_is_named(bad):
    with pytest.raises(ValueError, match="`embeddings`"):
        tfbs.CompressionOptions(embeddings=bad)
    with pytest.raises(ValueError, match="`embeddings`"):
        tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), embeddings=bad)
    with pytest.raises(ValueError, match="`embeddings`"):
        tfbs.BlockSparseCrossDeviceOps(k=1, exchange="allgather", embeddings=bad)


def test_cross_device_ops_apply_the_rule_by_path():
    """``BlockSparseCrossDeviceOps`` without a model knows the table by its path: with
    ``dense_below=50`` it keeps one row per device under ``"compress"``, all 12 under
    ``"by_size"``."""
    model = _model()
    layouts = tfbs.blocks.layouts_for(model.trainable_variables)
    assert layouts[0].embedding and layouts[0].layer_class in (None, "Embedding")
    for rule, rows in (("compress", 1), ("by_size", VOCAB)):
        ops = tfbs.BlockSparseCrossDeviceOps(k=1, exchange="allgather",
                                             dense_below=DENSE_BELOW, embeddings=rule)
        comp = tfbs.feedback.compressor_for(ops.options, layouts)
        assert comp.counts[0] == rows
        assert comp.whole[1:] == (False, True)  # 60-element kernel compressed, bias whole
