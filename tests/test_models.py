"""Tests of the model zoo: shapes, sizes, block tables, toy NMT data and training."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tf_blocksparse as tfbs
from models import nmt, registry
from models.resnet import resnet20
from models.vgg import head_fraction, vgg_fc
from tests.versions import needs_keras_315_attention

IMAGE_MODELS = ("resnet20", "vgg_fc", "cnn_small")
SHAPES = ((28, 28, 1), (32, 32, 3))


def _compile(model: keras.Model, run_eagerly: bool = False) -> None:
    opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), k=1,
                                    exchange="allgather")
    model.compile(optimizer=opt, run_eagerly=run_eagerly,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _images(shape: tuple[int, ...], n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, *shape)).astype(np.float32),
            rng.integers(0, 10, size=n).astype(np.int32))


# Tracing ResNet-20's step with the wrapper takes most of a minute on 2 busy cores: that
# case runs with `make test-slow` (its eager step stays here).
@pytest.mark.parametrize("name,shape", [
    pytest.param(n, s, marks=pytest.mark.slow) if (n, s) == ("resnet20", SHAPES[0]) else (n, s)
    for n in IMAGE_MODELS for s in SHAPES])
def test_image_model_trains_one_step(name: str, shape: tuple[int, int, int]) -> None:
    model = registry.build_model(name, shape, 10, seed=0)
    assert model.output_shape == (None, 10)
    # Graph mode (what fit really runs) at 28x28x1; eager at 32x32x3 only to keep the file
    # fast: tracing ResNet-20 with the wrapper costs ~10 s on CPU, an eager step ~1 s.
    _compile(model, run_eagerly=shape == (32, 32, 3))
    x, y = _images(shape)
    hist = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])


def test_vgg_fc_trains_under_mirrored_strategy(mirrored2) -> None:
    with mirrored2.scope():
        model = vgg_fc((28, 28, 1), 10, fc_units=256, seed=0)
        _compile(model)
    x, y = _images((28, 28, 1))
    before = [w.copy() for w in model.get_weights()]
    hist = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0])
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_models_build_for_digits(name: str) -> None:
    model = registry.build_model(name, (8, 8, 1), 10, seed=0)
    assert model.output_shape == (None, 10)
    assert model.predict(np.zeros((2, 8, 8, 1), np.float32), verbose=0).shape == (2, 10)


def test_resnet20_parameter_count() -> None:
    model = resnet20()  # CIFAR-10's 32x32x3 images and 10 classes by default
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)
    params = model.count_params()
    assert abs(params - 0.27e6) / 0.27e6 < 0.05, params
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    assert len([c for c in convs if c.kernel_size == (3, 3)]) == 19  # + the Dense = 20


@pytest.mark.parametrize("shape", SHAPES)
def test_vgg_fc_head_holds_most_parameters(shape: tuple[int, int, int]) -> None:
    model = vgg_fc(shape, 10)
    names = [layer.name for layer in model.layers]
    assert names[names.index("flatten") + 1:] == ["fc1", "fc2", "logits"]
    assert head_fraction(model) > 0.8


@pytest.mark.parametrize("fc_units", (1024, 96))
def test_vgg_fc_block_table_one_block_per_fc1_unit(fc_units: int) -> None:
    rows = {"/".join(row.path.split("/")[-2:]): row
            for row in tfbs.block_table(vgg_fc((28, 28, 1), fc_units=fc_units))}
    fc1 = rows["fc1/kernel"]
    assert fc1.rule == "output_channel" and fc1.num_blocks == fc_units
    assert fc1.block_size == 7 * 7 * 64
    assert rows["conv1_1/kernel"].num_blocks == 32


def test_toy_translation_is_deterministic() -> None:
    (e1, d1), t1 = nmt.make_toy_translation(64, seed=3)
    (e2, d2), t2 = nmt.make_toy_translation(64, seed=3)
    (e3, _), _ = nmt.make_toy_translation(64, seed=4)
    for a, b in ((e1, e2), (d1, d2), (t1, t2)):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int32 and a.shape == (64, 9)
    assert not np.array_equal(e1, e3)


def test_toy_translation_target_is_mapped_reverse_of_source() -> None:
    vocab, max_len = 11, 5
    (enc_in, dec_in), target = nmt.make_toy_translation(200, seed=1, src_vocab=vocab,
                                                        max_len=max_len)
    table = nmt.toy_vocab_map(vocab)
    assert sorted(table[nmt.NUM_SPECIAL:]) == list(range(nmt.NUM_SPECIAL, vocab))
    np.testing.assert_array_equal(table[:nmt.NUM_SPECIAL], np.arange(nmt.NUM_SPECIAL))
    lengths = set()
    for src, dec, tgt in zip(enc_in, dec_in, target):
        n = int(np.argmax(src == nmt.EOS))
        lengths.add(n)
        x = src[:n]
        assert (x >= nmt.NUM_SPECIAL).all() and (src[n + 1:] == nmt.PAD).all()
        np.testing.assert_array_equal(tgt[:n], table[x[::-1]])
        assert tgt[n] == nmt.EOS and (tgt[n + 1:] == nmt.PAD).all()
        np.testing.assert_array_equal(dec[:n + 1], np.concatenate([[nmt.BOS], tgt[:n]]))
        assert (dec[n + 1:] == nmt.PAD).all()
    assert len(lengths) > 1  # variable lengths


def test_masked_loss_and_accuracy_ignore_pad() -> None:
    y = np.array([[3, 4, 0, 0]], np.int32)
    logits = np.full((1, 4, 5), -10.0, np.float32)
    logits[0, 0, 3] = logits[0, 1, 4] = 10.0  # right where it counts, wrong on PAD
    logits[0, 2:, 1] = 10.0
    assert float(nmt.token_accuracy(y, logits)) == 1.0
    assert float(nmt.masked_sparse_ce(y, logits)) < 1e-3


# Trains to a low loss (~16 s): `make test-slow` (CI runs it).
@pytest.mark.slow
@needs_keras_315_attention
def test_gru_nmt_learns_with_block_sparse_exchange() -> None:
    vocab = 12
    (enc_in, dec_in), target = nmt.make_toy_translation(2000, seed=0, src_vocab=vocab,
                                                        max_len=6)
    model = registry.build_model("gru_nmt", (vocab,), vocab, seed=0, embed_dim=16, units=32)
    assert model.output_shape == (None, None, vocab)
    model.compile(
        optimizer=tfbs.BlockSparseOptimizer(keras.optimizers.Adam(1e-2), density=0.1,
                                            exchange="allgather"),
        loss=nmt.masked_sparse_ce, metrics=[nmt.token_accuracy])
    hist = model.fit([enc_in, dec_in], target, batch_size=32, epochs=4, verbose=0).history
    assert hist["loss"][-1] < 0.8 * hist["loss"][0], hist
    assert hist["token_accuracy"][-1] > hist["token_accuracy"][0] + 0.1, hist
    assert model.optimizer.block_sparse_metrics()["blocks_kept"] > 0

    out = nmt.greedy_translate(model, enc_in[:16], max_len=7)
    assert out.shape == (16, 7) and out.dtype == np.int32
    assert ((out >= 0) & (out < vocab)).all()
    for row in out:  # nothing but PAD after the first EOS
        eos = np.flatnonzero(row == nmt.EOS)
        if eos.size:
            assert (row[eos[0] + 1:] == nmt.PAD).all()


def test_registry() -> None:
    assert set(registry.MODELS) == {"resnet20", "vgg_fc", "cnn_small", "gru_nmt", "lstm_nmt",
                                    "cnn_bn", "resnet50", "resnet101", "vgg16"}
    assert set(registry.DATASET_MODELS) == {"resnet20", "vgg_fc", "cnn_small", "cnn_bn",
                                            "gru_nmt", "lstm_nmt"}
    assert registry.is_sequence_model("gru_nmt") and registry.is_sequence_model("lstm_nmt")
    assert not any(registry.is_sequence_model(n) for n in IMAGE_MODELS)
    with pytest.raises(ValueError, match="no_such_net"):
        registry.build_model("no_such_net", (28, 28, 1), 10)
    model = registry.build_model("vgg_fc", (8, 8, 1), 3, fc_units=32)
    assert model.get_layer("fc1").units == 32 and model.output_shape == (None, 3)


def test_cnn_bn_outputs_logits_and_trains() -> None:
    """The benchmarks' four conv-BatchNorm block network, under its own name."""
    model = registry.build_model("cnn_bn", (16, 16, 3), 10, seed=0)
    assert model.name == "cnn_bn" and model.output_shape == (None, 10)
    assert sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers) == 4
    assert model.layers[-1].activation is keras.activations.linear
    _compile(model, run_eagerly=True)
    x, y = _images((16, 16, 3))
    assert np.isfinite(model.fit(x, y, batch_size=8, epochs=1, verbose=0).history["loss"][0])


def test_lstm_nmt_is_gru_nmt_with_lstm_layers() -> None:
    """Same layers, inputs and outputs; the decoder LSTM starts from the encoder's [h, c]."""
    gru = registry.build_model("gru_nmt", (12,), 12, seed=0, embed_dim=8, units=16)
    lstm = registry.build_model("lstm_nmt", (12,), 12, seed=0, embed_dim=8, units=16)
    assert lstm.name == "lstm_nmt" and lstm.output_shape == gru.output_shape
    assert isinstance(lstm.get_layer("enc_lstm"), keras.layers.LSTM)
    assert isinstance(lstm.get_layer("dec_lstm"), keras.layers.LSTM)
    assert [v.shape for v in lstm.get_layer("dec_lstm").weights] == [(8, 64), (16, 64), (64,)]
    (enc, dec), _ = nmt.make_toy_translation(4, seed=0, src_vocab=12, max_len=5)
    assert lstm.predict([enc, dec], verbose=0).shape == (4, dec.shape[1], 12)
    with pytest.raises(ValueError, match="cell"):
        nmt.gru_nmt(12, 12, cell="rnn")


def test_default_inputs_and_square_image_builds() -> None:
    assert registry.default_input("resnet50") == ((224, 224, 3), 1000)
    assert registry.default_input("cnn_small") == ((32, 32, 3), 10)
    with pytest.raises(ValueError, match="gru_nmt"):
        registry.default_input("gru_nmt")
    with pytest.raises(ValueError, match="alexnet"):
        registry.build_image_model("alexnet")
    model = registry.build_image_model("resnet50", 32, 10, seed=0)  # keras.applications
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)
    assert model.layers[-1].activation is keras.activations.linear  # logits, like the rest
    assert registry.build_image_model("cnn_bn").input_shape == (None, 32, 32, 3)
