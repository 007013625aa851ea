"""``BlockSparseMetrics``: TensorBoard steps are the optimizer's iterations (also after a
``BackupAndRestore`` resume) and an epoch's figures are the means of its steps' (2 real
replicas)."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.batches import fit_in_order

STEPS_PER_EPOCH = 4  # 64 examples, batches of 16


def _model_and_optimizer(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(4)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05), k=1, dense_below=0,
                                        exchange="allgather")
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    return model, opt


def _xy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16 * STEPS_PER_EPOCH, 8, 8, 1)).astype("float32")
    return x, rng.integers(0, 4, len(x)).astype("int32")


def _scalars(log_dir, tag):
    """``[(step, value)]`` of the TensorBoard scalar ``tag`` in ``log_dir/block_sparse``."""
    out = []
    for path in sorted(glob.glob(f"{log_dir}/block_sparse/events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    out.append((event.step, float(tf.make_ndarray(value.tensor))))
    return out


class _StopAt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_resumed_fit_logs_from_the_restored_iteration(mirrored2, tmp_path):
    """Two epochs, an interruption, then a fresh process state resuming from the backup:
    its epoch 2 is logged at step 12 (three epochs of 4 steps), not 4."""
    x, y = _xy()
    backup = str(tmp_path / "backup")
    model, _ = _model_and_optimizer(mirrored2)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit_in_order(model, x, y, 16, 4, callbacks=[
            keras.callbacks.BackupAndRestore(backup),
            tfbs.BlockSparseMetrics(log_dir=str(tmp_path / "first")), _StopAt(2)])
    assert [s for s, _ in _scalars(tmp_path / "first", "payload_bytes")] == [4, 8]
    model, opt = _model_and_optimizer(mirrored2)
    hist = fit_in_order(model, x, y, 16, 4, callbacks=[
        keras.callbacks.BackupAndRestore(backup),
        tfbs.BlockSparseMetrics(log_dir=str(tmp_path / "resumed"))])
    assert len(hist.history["loss"]) == 2  # epochs 2 and 3
    assert int(opt.iterations.numpy()) == 4 * STEPS_PER_EPOCH
    for tag in ("payload_bytes", "residual_norm", "skipped_steps"):
        assert [s for s, _ in _scalars(tmp_path / "resumed", tag)] == [12, 16], tag


def test_epoch_figures_are_the_means_of_its_steps(mirrored2, tmp_path):
    """With ``update_freq=1`` the batch logs hold each step's figures; the epoch's are their
    means (the residual norm changes every step), ``skipped_steps`` a total, and TensorBoard
    gets each batch at its iteration."""
    model, opt = _model_and_optimizer(mirrored2)
    steps = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(dict(logs))

    hist = fit_in_order(model, *_xy(), 16, 2, callbacks=[
        tfbs.BlockSparseMetrics(log_dir=str(tmp_path), update_freq=1), Batches()])
    for epoch in range(2):
        batch = steps[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH]
        norms = [b["residual_norm"] for b in batch]
        assert len(set(norms)) > 1, norms
        assert hist.history["residual_norm"][epoch] == pytest.approx(np.mean(norms), rel=1e-6)
        assert hist.history["exchange_s"][epoch] == pytest.approx(
            np.mean([b["exchange_s"] for b in batch]), rel=1e-5)
        assert hist.history["payload_bytes"][epoch] == batch[-1]["payload_bytes"]
        assert hist.history["skipped_steps"][epoch] == 0.0
    assert [s for s, _ in _scalars(tmp_path, "residual_norm")] == list(range(1, 9))
    assert opt.block_sparse_metrics()["residual_norm"] == steps[-1]["residual_norm"]
