"""Per-replica optimizer state saved and restored per worker, on 2 real replicas."""

import json
import os
import shutil
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.interrupt import Die
from tf_blocksparse import _compat
from tf_blocksparse.keras import replica_state
from tf_blocksparse.keras.backup import BackupAndRestore


def _model(strategy, seed=1):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(40, activation="relu"),
                                  keras.layers.Dense(3)])
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                        exchange="allgather", k=1, dense_below=0)
        model.compile(opt, "mse")
    return model


def _data(skip=0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat().skip(skip)


def _per_replica(opt):
    return [[p.numpy() for p in _compat.local_components(v)]
            for v in replica_state.state_variables(opt)]


@pytest.fixture(scope="module")
def trained(mirrored2) -> keras.Model:
    """A model fitted for 3 steps, shared by the tests that only read its optimizer's state
    (they never train it or write into it)."""
    model = _model(mirrored2)
    model.fit(_data(), epochs=1, steps_per_epoch=3, verbose=0)
    return model


def test_each_replica_gets_its_own_state_back(mirrored2, tmp_path):
    model = _model(mirrored2)
    model.fit(_data(), epochs=1, steps_per_epoch=3, verbose=0)
    opt = model.optimizer
    saved = _per_replica(opt)
    assert any(not np.array_equal(a, b) for a, b in saved)  # the replicas' states differ
    replica_state.save(opt, str(tmp_path), 0, 1)
    for v in replica_state.state_variables(opt):
        for p in _compat.local_components(v):
            p.assign(tf.zeros_like(p))
    assert replica_state.restore(opt, str(tmp_path), 0, 1)
    for want, got in zip(saved, _per_replica(opt)):
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


def test_a_failed_background_write_is_raised_when_joined(mirrored2, tmp_path):
    """A background write that fails (here: its temporary file's name is taken by a folder)
    raises, naming the file, where the backup joins it; a later write goes through."""
    model = _model(mirrored2)
    model.fit(_data(), epochs=1, steps_per_epoch=1, verbose=0)
    os.makedirs(tmp_path / "worker_0.npz.tmp")
    writer = replica_state.save(model.optimizer, str(tmp_path), 0, 1, background=True)
    with pytest.raises(OSError, match="worker_0.npz"):
        writer.join()
    writer.join()  # raised once
    os.rmdir(tmp_path / "worker_0.npz.tmp")
    replica_state.save(model.optimizer, str(tmp_path), 0, 1, background=True).join()
    assert replica_state.restore(model.optimizer, str(tmp_path), 0, 1)


def test_a_failed_last_write_is_raised_when_training_ends(mirrored2, tmp_path):
    """The backup's last state file cannot be written: ``fit`` raises, naming it, once the
    backup is finished with (the chief still removes the folder)."""
    model, backup = _model(mirrored2), tmp_path / "backup"
    os.makedirs(backup / "replica_state" / "worker_0.npz.tmp")
    with pytest.raises(OSError, match="worker_0.npz"):
        model.fit(_data(), epochs=1, steps_per_epoch=2, verbose=0,
                  callbacks=[BackupAndRestore(str(backup))])
    assert not backup.exists()


def test_the_state_file_is_written_by_the_given_writer(mirrored2, tmp_path):
    """``BackupAndRestore(write_state=...)`` writes every backup's state file through it (here
    one that records and then writes); anything else than a function is refused up front."""
    calls = []

    def write(arrays, meta, directory, worker_index, num_workers):
        calls.append((meta["iterations"], worker_index, num_workers))
        replica_state.write_file(arrays, meta, directory, worker_index, num_workers)

    model, backup = _model(mirrored2), tmp_path / "backup"
    model.fit(_data(), epochs=2, steps_per_epoch=2, verbose=0,
              callbacks=[BackupAndRestore(str(backup), write_state=write,
                                          delete_checkpoint=False)])
    assert calls == [(2, 0, 1), (4, 0, 1)]
    assert (backup / "replica_state" / "worker_0.npz").exists()
    with pytest.raises(TypeError, match="write_state"):
        BackupAndRestore(str(backup), write_state="fast")


def test_another_replica_count_gets_the_sum_over_n_with_a_warning(trained, tmp_path):
    model = trained
    saved = _per_replica(model.optimizer)
    replica_state.save(model.optimizer, str(tmp_path), 0, 1)
    one = tf.distribute.MirroredStrategy(["/cpu:0"])
    single = _model(one)
    steps = model.optimizer.iterations.numpy()
    with one.scope():
        single.optimizer.build(single.trainable_variables)
        single.optimizer.iterations.assign(steps)
    with pytest.warns(UserWarning, match="saved by 2 replicas onto 1"):
        assert replica_state.restore(single.optimizer, str(tmp_path), 0, 1)
    for want, got in zip(saved, _per_replica(single.optimizer)):
        np.testing.assert_allclose(got[0], want[0] + want[1], rtol=1e-6, atol=1e-7)


def test_an_incomplete_set_is_refused(mirrored2, tmp_path):
    model = _model(mirrored2)
    model.fit(_data(), epochs=1, steps_per_epoch=2, verbose=0)
    assert not replica_state.restore(model.optimizer, str(tmp_path), 0, 1)  # nothing saved
    replica_state.save(model.optimizer, str(tmp_path), 0, 2)  # worker 1's file never came
    with pytest.raises(replica_state.MissingState, match="incomplete"):
        replica_state.restore(model.optimizer, str(tmp_path), 0, 2)
    with model.distribute_strategy.scope():
        model.optimizer.iterations.assign_add(1)  # a file of another step does not match
    replica_state.save(model.optimizer, str(tmp_path), 1, 2)
    with pytest.raises(replica_state.MissingState):
        replica_state.restore(model.optimizer, str(tmp_path), 0, 2)


def _interrupted(strategy, backup, after):
    model = _model(strategy)
    with pytest.raises(RuntimeError, match="killed"):
        model.fit(_data(), epochs=3, steps_per_epoch=4, verbose=0,
                  callbacks=[BackupAndRestore(backup), Die(after)])


def test_resume_is_exact_and_a_torn_backup_falls_back(mirrored2, tmp_path):
    """Killed mid-epoch 3 and resumed: the weights of the uninterrupted run, bit for bit.
    With the last backup's state files missing (a crash while they were written; here a copy
    of the same backup), the run goes back to the backup before it."""
    whole = _model(mirrored2)
    whole.fit(_data(), epochs=3, steps_per_epoch=4, verbose=0)
    backup, torn = str(tmp_path / "b"), str(tmp_path / "torn")
    _interrupted(mirrored2, backup, after=10)  # backups after epochs 1 and 2
    assert json.loads(open(os.path.join(backup, "training_metadata.json")).read())["epoch"] == 2
    shutil.copytree(backup, torn)
    resumed = _model(mirrored2)
    resumed.fit(_data(8), epochs=3, steps_per_epoch=4, verbose=0,
                callbacks=[BackupAndRestore(backup)])
    for a, b in zip(whole.weights, resumed.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert not os.path.exists(backup)

    state = os.path.join(torn, "replica_state", "worker_0.npz")
    os.remove(state)  # the last state file never landed: only the one before (.bkp) is there
    os.rename(state + ".bkp", state)
    again = _model(mirrored2)
    again.fit(_data(4), epochs=3, steps_per_epoch=4, verbose=0,
              callbacks=[BackupAndRestore(torn)])
    assert int(again.optimizer.iterations.numpy()) == 12  # resumed after epoch 1: 4 + 8 steps
    for a, b in zip(whole.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_model_keras_still_holds_the_sums(mirrored2, trained, tmp_path):
    model = trained
    sums = [a + b for a, b in _per_replica(model.optimizer)]
    path = str(tmp_path / "m.keras")
    tfbs.save_model(model, path)
    with mirrored2.scope(), warnings.catch_warnings():
        loaded = keras.models.load_model(path)
    for v, want in zip(replica_state.state_variables(loaded.optimizer), sums):
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6)  # each replica sum / 2
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_cluster_value_is_exact_on_one_worker_and_scaled_from_its_replicas_on_several(
        trained):
    model = trained
    variable = model.optimizer.residuals[0]
    a, b = _per_replica(model.optimizer)[0]
    np.testing.assert_allclose(replica_state.cluster_value(variable, 2), a + b, rtol=1e-6)
    # as one of 3 workers with 2 replicas each: 6 x the local mean
    np.testing.assert_allclose(replica_state.cluster_value(variable, 6), 3 * (a + b),
                               rtol=1e-6)
