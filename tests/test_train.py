"""launch/train.py: flags, a real 2-worker cluster, failure, kill-and-resume."""

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from absl import flags

from launch.cluster.local import run_local_cluster
from tests.saved_files import final_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [sys.executable, "-m", "launch.train", "--strategy=multiworker",
         "--dataset=digits", "--model=cnn_small", "--batch_size=64"]
ENV = {"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
FIELDS = ("test_accuracy", "test_loss", "test_examples", "test_correct", "epochs", "steps",
          "wall_s", "payload_bytes_per_step", "dense_bytes_per_step", "num_workers", "flags")


def _flag_values(*args):
    from launch.flags import define_flags

    fv = flags.FlagValues()
    define_flags(fv)
    fv(["train.py", *args])
    return fv


def test_flags_parse_and_validate():
    fv = _flag_values("--model=vgg_fc", "--compression=topk", "--density=0.01",
                      "--exchange=shared", "--epochs=3")
    assert (fv.model, fv.compression, fv.density, fv.exchange, fv.epochs) == (
        "vgg_fc", "topk", 0.01, "shared", 3)
    assert fv.data_dir == "/usr/share/datasets/fashion-mnist"
    for bad in (["--k=1", "--density=0.5"], ["--density=1.5"], ["--k=0"], ["--dataset=mnist"],
                ["--model=resnet50"], ["--strategy=tpu"], ["--dataset=tfds:"],
                ["--stop_at_accuracy=1.5"], ["--stop_at_accuracy=0.5", "--novalidate"],
                ["--min_epochs=0"], ["--density_warmup=0"], ["--density_warmup=0.5,x"],
                ["--density_warmup=1.5"]):
        with pytest.raises(flags.Error):
            _flag_values(*bad)


@pytest.mark.parametrize("args, named", [
    (["--compression=dense", "--k=5"], "--k"),
    (["--compression=dense", "--density=0.1"], "--density"),
    (["--compression=dense", "--density_warmup=0.5"], "--density_warmup"),
    (["--compression=dense", "--dense_below=0"], "--dense_below"),
    (["--compression=dense", "--momentum_masking=none"], "--momentum_masking"),
    (["--compression=dense", "--quantize=int8"], "--quantize"),
    (["--compression=dense", "--exchange=allgather"], "--exchange"),
    (["--compression=dense", "--metric=l2"], "--metric"),
    (["--outer_momentum=0.9"], "--outer_momentum"),
    (["--num_devices=0"], "num_devices"),
    (["--lr=0"], "--lr"),
    (["--momentum=1.5"], "--momentum"),
    (["--save_freq=5"], "--save_freq"),
    (["--synthetic_shape=0,3"], "--synthetic_shape"),
    (["--fail_worker=-1"], "--fail_worker"),
])
def test_bad_flag_combinations_are_refused_at_parsing(args, named):
    """A flag the run would silently ignore, or a value TF would fail on deep inside, is an
    error at flag parsing that names the flag."""
    with pytest.raises(flags.Error, match=named):
        _flag_values(*args)
    _flag_values("--compression=block", "--k=5", "--dense_below=0")  # the sparse ones take them


def test_helpfull_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "launch.train",
                          "--helpfull"], capture_output=True, text=True, env=dict(
                              os.environ, **ENV), timeout=120)
    for name in ("--model", "--dataset", "--data_dir", "--strategy", "--compression", "--k",
                 "--density", "--metric", "--exchange", "--epochs", "--steps_per_epoch",
                 "--batch_size", "--lr", "--momentum", "--seed", "--model_dir"):
        assert name in out.stdout, name


#: Runs ``python -m launch.train ARGS`` in-process and prints, at exit, whether TensorFlow or
#: Keras got imported.
_HELP_PROBE = ("import atexit, runpy, sys\n"
               "atexit.register(lambda: print('IMPORTED', 'tensorflow' in sys.modules, "
               "'keras' in sys.modules))\n"
               "sys.argv = ['train', *sys.argv[1:]]\n"
               "runpy.run_module('launch.train', run_name='__main__')\n")


def _help_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HELP_PROBE, *args], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, **ENV), timeout=60)


def test_help_and_flag_errors_import_no_tensorflow():
    """``--help`` and a flag error answer at once: nothing imports TensorFlow or Keras
    before the flags are parsed."""
    out = _help_probe("--help")  # absl's --help exits with status 1
    assert "IMPORTED False False" in out.stdout, out.stderr
    for name in ("--model", "--dataset", "--compression", "--density", "--epochs"):
        assert name in out.stdout, name
    bad = _help_probe("--k=0")
    assert bad.returncode != 0 and "--k" in bad.stderr
    assert "IMPORTED False False" in bad.stdout


def test_help_leaves_out_the_testing_flags_helpfull_lists_them():
    short = _help_probe("--help").stdout
    full = _help_probe("--helpfull").stdout
    for name in ("--fail_at_step", "--fail_worker", "--dump_restored", "--slow_state_write_s"):
        assert name not in short, name
        assert name in full, name
    fv = _flag_values("--fail_at_step=3", "--fail_worker=0", "--dump_restored=/tmp/x")
    assert (fv.fail_at_step, fv.fail_worker, fv.dump_restored) == (3, 0, "/tmp/x")


def test_tfds_data_set_not_downloaded_ends_in_one_clear_line(tmp_path):
    """``--dataset=tfds:NAME`` offline with an empty ``--tfds_data_dir``: one ``FATAL`` line
    naming both flags and the download, no traceback, exit status 1."""
    pytest.importorskip("tensorflow_datasets")
    out = subprocess.run([sys.executable, "-m", "launch.train", "--dataset=tfds:mnist",
                          f"--tfds_data_dir={tmp_path}", "--epochs=1"], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, **ENV), timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    fatal = [line for line in out.stderr.splitlines() if line.startswith("FATAL")]
    assert len(fatal) == 1 and "--dataset=tfds:mnist" in fatal[0], out.stderr
    assert f"--tfds_data_dir={tmp_path}" in fatal[0] and "download" in fatal[0]


def test_optimizer_flags_follow_the_library_defaults():
    import keras

    import tf_blocksparse as tfbs
    from launch.config import TrainConfig
    from launch.optimizer import make_optimizer

    def optimizer(*args):
        config = TrainConfig.from_flags(_flag_values(*args))
        return make_optimizer(config.method, config.lr, config.momentum)

    lib = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    opt = optimizer()
    for key in ("k", "density", "metric", "exchange", "momentum_correction", "dense_below",
                "momentum_masking", "granularity"):
        assert getattr(opt, key) == getattr(lib, key), key
    assert opt.compression.auto and opt.momentum_correction == 0.9  # dense groups: inner SGD
    assert opt.inner_optimizer.momentum == pytest.approx(0.9)
    literal = optimizer("--global_momentum", "--dense_below=0")
    assert literal.momentum_correction is None and literal.inner_optimizer.momentum == 0.9
    assert literal.dense_below == 0
    partial = optimizer("--whole_momentum=0.7", "--momentum_masking=whole_except_norm")
    assert partial.momentum_policy == tfbs.MomentumCorrection(0.9, "whole_except_norm", 0.7)
    assert optimizer("--whole_momentum=0.5").momentum_policy == tfbs.MomentumCorrection(
        0.9, "whole", 0.5)


# One uninterrupted 3-epoch run serves two tests: what a run writes, and the reference of
# the kill-and-resume test: k=1, always compressed, the other defaults.
RESUMABLE = [*TRAIN, "--epochs=3", "--deterministic", "--compression=block", "--k=1",
             "--exchange=allgather"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The model directory of one uninterrupted, deterministic 2-worker run."""
    model_dir = tmp_path_factory.mktemp("train") / "whole"
    rc = run_local_cluster([*RESUMABLE, f"--model_dir={model_dir}"], 2, env=ENV, cwd=ROOT,
                           timeout_s=300)
    assert rc == 0
    return model_dir


def test_two_worker_cluster_trains_and_writes_metrics(whole_run):
    m = json.loads((whole_run / "metrics.json").read_text())
    for field in FIELDS:
        assert field in m, field
    assert m["num_workers"] == 2 and m["replicas"] == 2
    val = m["history"]["val_accuracy"]
    assert val[-1] > val[0] and m["test_accuracy"] > 0.2, val
    assert m["payload_bytes_per_step"] * 20 < m["dense_bytes_per_step"]
    assert m["flags"]["compression"] == "block" and m["flags"]["k"] == 1
    assert m["flags"]["deterministic"] is True
    # every one of digits' 360 test images counted once, and the saved model agrees
    assert m["test_examples"] == 360 and m["test_accuracy"] == m["test_correct"] / 360
    assert m["history"]["val_correct"][-1] == m["test_correct"]
    _check_saved_model(whole_run / "model.keras", m)


_LOAD = """
import json, sys
import keras, numpy as np
import tf_blocksparse  # registers BlockSparseOptimizer: nothing else is needed to load
from launch import data
model = keras.saving.load_model(sys.argv[1])
(_, _), (x, y) = data.load_digits()
logits = model.predict(x, batch_size=64, verbose=0)
loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)))
print(json.dumps({"correct": int(np.sum(np.argmax(logits, -1) == y)), "loss": loss,
                  "optimizer": type(model.optimizer).__name__}))
"""


def _check_saved_model(path, metrics):
    """The chief's model.keras loads in a fresh process and scores what metrics.json says."""
    assert path.exists() and not list(path.parent.glob("model.keras.worker_*"))
    out = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True,
                         text=True, env=dict(os.environ, **ENV), timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["optimizer"] == "BlockSparseOptimizer"
    assert got["correct"] == metrics["test_correct"]
    assert got["loss"] == pytest.approx(metrics["test_loss"], rel=1e-4)


# A 2-worker cluster (~18 s): `make test-slow` (CI runs it).
@pytest.mark.slow
def test_cluster_stops_together_at_the_target_accuracy(tmp_path):
    """--stop_at_accuracy: every worker sees the same reduced val_accuracy and stops after
    the same epoch (a worker that went on alone would hang the cluster); momentum correction
    (with "waited" masking) and a density warm-up (every worker re-traces its step at the
    same epoch) run under MultiWorkerMirroredStrategy."""
    rc = run_local_cluster([*TRAIN, "--compression=block", "--density=0.1",
                            "--exchange=allgather",
                            "--momentum_masking=waited",
                            "--density_warmup=0.5", "--epochs=6", "--steps_per_epoch=5",
                            "--stop_at_accuracy=0.01", "--min_epochs=2",
                            f"--model_dir={tmp_path}"], 2, env=ENV, cwd=ROOT,
                           timeout_s=300)
    assert rc == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["epochs_trained"] == 2 and m["steps"] == 10
    assert len(m["history"]["val_accuracy"]) == 2
    assert m["flags"]["global_momentum"] is False
    sent = m["history"]["payload_bytes"]
    assert sent[0] > sent[1] == m["payload_bytes_per_step"], sent


# A 2-worker cluster with the automatic exchange end to end: `make test-slow`.
@pytest.mark.slow
def test_auto_exchange_run_records_every_decision(tmp_path):
    """--exchange=auto: the record holds the build-time choice (step 0) and the re-decision
    after the warm-up, each with its modes and measured inputs."""
    rc = run_local_cluster([*TRAIN, "--compression=block", "--density=0.1",
                            "--exchange=allgather", "--exchange=auto",
                            "--fusion_buffer_bytes=4096", "--epochs=2", "--steps_per_epoch=12",
                            f"--model_dir={tmp_path}"], 2, env=ENV, cwd=ROOT, timeout_s=300)
    assert rc == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    steps = [d["step"] for d in m["auto_decisions"]]
    assert steps == [0, 20], steps  # AutoExchange's warmup_steps
    first, last = m["auto_decisions"]
    # build time: no step timed, the prior (8x all groups' compression) stands in
    assert first["auto_compute_ms"] >= 8 * first["auto_compress_ms"] - 1e-9
    assert last["auto_compute_ms"] > 0 and m["auto_measure_s"] > 0
    assert last["modes"] == m["auto_modes"] and len(last["modes"]) >= 2
    assert last["auto_sparse_groups"] + last["auto_dense_groups"] == len(last["modes"])


def test_every_step_trains_the_global_batch(mwms_runs):
    """Under MultiWorkerMirroredStrategy a step trains on --batch_size examples in all (each
    worker its share of its own shard), so an epoch is one pass over the training data
    (``tests/batch_count_worker.py``, a scenario of the shared launch ``mwms_runs``)."""
    for index in range(2):
        got = json.loads((mwms_runs / "batch_count" / f"count_{index}.json").read_text())
        assert got["examples"] == 64 * got["steps"], got


# Heavy (two 2-worker clusters, ~35 s): `make test-slow` (CI runs it).
@pytest.mark.slow
def test_kill_and_resume_is_exact_and_backups_read_no_replica_state(tmp_path, whole_run,
                                                                     capsys):
    """A 2-worker run killed mid-epoch and resumed ends with the same weights and optimizer
    state, bit for bit, as the uninterrupted run.  Each replica gets exactly its own residuals
    back from its worker's file; the chief's checkpoint holds no per-replica state (saving
    it needs no collective) and no worker writes a private checkpoint.  The failing worker
    fails the whole run at once: the launcher stops the other worker and names the failure."""
    args, whole, broken = RESUMABLE, whole_run, tmp_path / "broken"
    rc = run_local_cluster([*args, f"--model_dir={broken}", "--fail_at_step=30",
                            "--fail_worker=1"], 2, env=ENV, timeout_s=300, grace_s=3)
    assert rc == 17  # killed mid-epoch 2 (22 steps per epoch per worker), not 124 (timeout)
    out = capsys.readouterr().out
    assert "worker 1 failed with exit code 17" in out
    assert "fault injection: exiting after 30 steps" in out
    assert not (broken / "metrics.json").exists()  # the chief was stopped, not finished
    backup = broken / "backup"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no .worker_1
    assert sorted(p.name for p in whole.parent.iterdir()) == ["whole"]
    assert json.loads((backup / "training_metadata.json").read_text())["epoch"] == 1
    saved = [np.load(backup / "replica_state" / f"worker_{i}.npz") for i in range(2)]
    with h5py.File(backup / "latest.weights.h5", "r") as h5:
        opt_vars = len(h5["optimizer"]["vars"])
    assert opt_vars == 4  # iterations and learning rate of the wrapper and of the inner SGD
    rc = run_local_cluster([*args, f"--model_dir={broken}", "--slow_state_write_s=2",
                            f"--dump_restored={tmp_path}/restored"], 2, env=ENV, timeout_s=300)
    assert rc == 0
    m = json.loads((broken / "metrics.json").read_text())
    # the history holds every epoch: the first from the progress saved before the kill
    assert m["initial_epoch"] == 1 and m["history_from_epoch"] == 0
    assert len(m["history"]["loss"]) == 3 and m["epochs_trained"] == 3
    for i, state in enumerate(saved):
        restored = np.load(tmp_path / f"restored.worker_{i}.npz")
        meta = json.loads(str(state["meta"]))
        residuals = [k for k, n in enumerate(meta["names"]) if "residual" in n]
        assert len(residuals) == len(restored.files) > 0
        for key, k in zip(restored.files, residuals):  # this replica's own, not sum / N
            np.testing.assert_array_equal(restored[key], state[f"s{k}_r0"])
        # the compressed kernels' residuals are non-zero (those sent whole are zero), and
        # the two workers' differ: each got its own back
        nonzero = [k for k in residuals if np.any(state[f"s{k}_r0"] != 0)]
        assert len(nonzero) >= 2, meta["names"]
    assert any(np.any(saved[0][f"s{k}_r0"] != saved[1][f"s{k}_r0"]) for k in nonzero)
    assert not (broken / "backup").exists()  # removed at the end, as Keras does
    # --deterministic: the resumed run reproduces the uninterrupted run's figures exactly
    ref = json.loads((whole / "metrics.json").read_text())
    for key in ("test_correct", "test_loss", "test_examples"):
        assert m[key] == ref[key], key
    assert m["history"]["val_loss"] == ref["history"]["val_loss"]
    assert m["history"]["val_correct"] == ref["history"]["val_correct"]
    assert all(a < b for a, b in zip(m["train_s_per_epoch"], m["train_s_per_epoch"][1:]))
    a, b = final_weights(whole), final_weights(broken)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_epoch_clock_counts_training_steps_only():
    """Work after an epoch's last step (evaluation, a checkpoint that reads per-replica state
    through a collective) is not training time, whichever callback runs it and wherever the
    clock sits in ``callbacks``."""
    import keras

    from launch.callbacks import epoch_clock

    now = [0.0]

    class Step(keras.callbacks.Callback):  # every training step "takes" 1 s
        def on_train_batch_begin(self, batch, logs=None):
            now[0] += 1.0

    class SlowEpochEnd(keras.callbacks.Callback):  # an evaluation that "takes" 100 s
        def on_epoch_end(self, epoch, logs=None):
            now[0] += 100.0

    x = np.zeros((12, 3), "float32")
    y = np.zeros((12, 1), "float32")
    for order in ("before", "after"):
        now[0] = 0.0
        clock = epoch_clock(timer=lambda: now[0])
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        callbacks = [Step(), SlowEpochEnd(), clock] if order == "before" else \
            [Step(), clock, SlowEpochEnd()]
        model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0, shuffle=False)
        assert clock.train_s == [3.0, 6.0], order


def test_epoch_clock_starts_after_the_barrier():
    """The wait for the last worker at an epoch's start (its barrier) is not training time;
    the barrier runs once per epoch, before the clock is read."""
    import keras

    from launch.callbacks import epoch_clock

    now, waits = [0.0], []

    class Step(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            now[0] += 1.0

    def barrier():  # another worker "still evaluating" for 50 s
        waits.append(now[0])
        now[0] += 50.0

    clock = epoch_clock(timer=lambda: now[0], barrier=barrier)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32"), batch_size=4,
              epochs=2, callbacks=[Step(), clock], verbose=0, shuffle=False)
    assert clock.train_s == [2.0, 4.0] and waits == [0.0, 52.0]


def test_epoch_clock_counts_the_work_before_training():
    """A method's work before the first epoch (the automatic exchange's build-time
    measurements) is training time: ``before_s`` is added to the first epoch, read once
    training begins."""
    import keras

    from launch.callbacks import epoch_clock

    now, measured = [0.0], [0.0]

    class Step(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            now[0] += 1.0

    x = np.zeros((8, 3), "float32")
    y = np.zeros((8, 1), "float32")
    clock = epoch_clock(timer=lambda: now[0], before_s=lambda: measured[0])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    measured[0] = 2.5  # what the optimizer's build spent measuring
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[Step(), clock], verbose=0,
              shuffle=False)
    assert clock.train_s == [4.5, 6.5]


def test_timed_callback_counts_its_epoch_end_work_per_epoch():
    """cb.timed forwards every hook and sums, per epoch, the seconds of the wrapped
    callback's batch-end and epoch-end work (what an evaluation or a backup costs)."""
    import keras

    from launch.callbacks import launch_seconds, timed, wall_clock

    now = [0.0]
    calls = []

    class Slow(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            calls.append("begin")
            now[0] += 50.0  # a restore: not an epoch's cost

        def on_train_batch_end(self, batch, logs=None):
            now[0] += 0.5

        def on_epoch_end(self, epoch, logs=None):
            calls.append(epoch)
            logs["seen"] = 1.0
            now[0] += 10.0 * (epoch + 1)

    wrapped = timed(Slow(), timer=lambda: now[0])
    since = launch_seconds({"TFBS_LAUNCH_TIME": "100.0"}, clock=lambda: 100.0 + now[0])
    wall = wall_clock(since)
    x = np.zeros((8, 3), "float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    hist = model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[wrapped, wall])
    assert calls == ["begin", 0, 1] and hist.history["seen"] == [1.0, 1.0]
    assert wrapped.seconds_per_epoch == [11.0, 21.0]  # 2 batches x 0.5 s + the epoch end
    assert wall.start_s == 50.0 and wall.epoch_wall_s == [61.0, 82.0]
