"""Exact evaluation: every example counted once, on 1, 2 and 3 replicas / worker processes."""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch.local_cluster import run_local_cluster
from tests import eval_worker
from tf_blocksparse.keras.evaluation import ExactValidation, evaluate_exactly

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference(model, x, y, batch):
    """Single-process ``model.evaluate`` of the same weights (no strategy)."""
    return model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)


def test_mirrored_equals_single_process_evaluate(mirrored2):
    x, y = eval_worker.cnn_data()
    with mirrored2.scope():
        model = eval_worker.build_cnn()
    plain = eval_worker.build_cnn()
    plain.set_weights(model.get_weights())
    ref = _reference(plain, x, y, eval_worker.BATCH)
    for batch in (1, 7, 64, 500):
        r = evaluate_exactly(model, x, y, batch_size=batch)
        assert r.examples == r.counted == len(y)
        assert r.correct / len(y) == pytest.approx(ref["accuracy"], abs=1e-7)
        assert r.loss == pytest.approx(ref["loss"], rel=1e-5)
        logits = plain.predict(x, verbose=0)
        assert r.correct == int(np.sum(np.argmax(logits, -1) == y))


def test_constant_model_counts_every_example_once(mirrored2):
    x, y = eval_worker.constant_data()
    with mirrored2.scope():
        model = eval_worker.build_constant()
    r = evaluate_exactly(model, x, y, batch_size=256)
    assert (r.correct, r.counted) == (130, 360)
    logits = np.array([1.0, 0.5, 0.0])
    expected = np.mean(np.log(np.exp(logits).sum()) - logits[y])
    assert r.loss == pytest.approx(expected, rel=1e-6)


def test_sequence_labels_skip_the_ignored_label():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 5, 3)).astype("float32")
    y = rng.integers(0, 4, (9, 5)).astype("int32")
    y[:, -2:] = 0  # padding
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(4)])
    model.compile(loss="sparse_categorical_crossentropy")
    loss = lambda t, p: keras.losses.sparse_categorical_crossentropy(  # noqa: E731
        t, p, from_logits=True)
    r = evaluate_exactly(model, x, y, batch_size=4, loss=loss, ignore_label=0)
    logits = model.predict(x, verbose=0)
    mask = y != 0
    assert r.counted == int(mask.sum()) and r.examples == 9
    assert r.correct == int(((np.argmax(logits, -1) == y) & mask).sum())
    ce = loss(y, logits).numpy()
    assert r.loss == pytest.approx(ce[mask].mean(), rel=1e-5)


def test_regularisation_is_added_like_model_evaluate():
    x, y = eval_worker.cnn_data()
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(3, kernel_regularizer="l2")])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    ref = _reference(model, x, y, 64)
    r = evaluate_exactly(model, x, y, batch_size=64)
    assert r.loss == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": True}, "batch_size"),
    ({"y": np.zeros(3, "int32")}, "`y` has 3 rows"),
    ({"loss": lambda t, p: tf.reduce_mean(p)}, "`loss` must return one value per label"),
    ({"loss": 3}, "`loss` must be"),
])
def test_bad_arguments_are_named(kwargs, match):
    x, y = eval_worker.cnn_data()
    model = eval_worker.build_cnn()
    args = {"x": x, "y": y, "batch_size": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        evaluate_exactly(model, **args)


def test_uncompiled_model_needs_a_loss():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="`loss`"):
        evaluate_exactly(model, np.zeros((2, 4), "float32"), np.zeros(2, "int32"))


def test_callback_writes_exact_figures_into_history(mirrored2):
    x, y = eval_worker.cnn_data()
    with mirrored2.scope():
        model = eval_worker.build_cnn()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model.loss)
    cb = ExactValidation(x, y, batch_size=50)
    hist = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[cb])
    assert len(hist.history["val_accuracy"]) == 2
    r = evaluate_exactly(model, x, y, batch_size=50)
    assert hist.history["val_accuracy"][-1] == r.accuracy
    assert hist.history["val_correct"][-1] == r.correct
    assert hist.history["val_loss"][-1] == pytest.approx(r.loss, rel=1e-12)


# Three workers (~16 s) in `make test-slow` (CI runs it); two here.
@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_multi_process_equals_single_process_evaluate(tmp_path, workers, request):
    """Exact evaluation across 2 (the shared launch ``mwms_runs``) and 3 worker processes
    equals single-process evaluation of the same weights."""
    if workers == 2:
        tmp_path = request.getfixturevalue("mwms_runs") / "evaluation"
    else:
        cmd = [sys.executable, os.path.join(ROOT, "tests", "eval_worker.py"), str(tmp_path)]
        rc = run_local_cluster(cmd, workers, env={"PYTHONPATH": ROOT}, timeout_s=240)
        assert rc == 0, f"the {workers}-worker cluster exited with {rc}"
    results = [json.loads((tmp_path / f"eval_{i}.json").read_text()) for i in range(workers)]
    assert all(r == results[0] for r in results), "workers disagree"
    assert results[0]["replicas"] == workers
    plain = eval_worker.build_cnn()
    saved = np.load(tmp_path / "eval_0.npz")
    plain.set_weights([saved[k] for k in saved.files])
    x, y = eval_worker.cnn_data()
    ref = _reference(plain, x, y, eval_worker.BATCH)
    cnn = results[0]["cnn"]
    assert cnn["examples"] == cnn["counted"] == eval_worker.N
    assert cnn["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-7)
    assert cnn["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    const = results[0]["constant"]
    assert (const["correct"], const["counted"]) == (130, 360)
    assert const["accuracy"] == pytest.approx(130 / 360)
    print("model.evaluate on the replicated set:", results[0]["keras_evaluate"])
