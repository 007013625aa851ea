"""The cluster modes of the launch scripts (``launch/train_pipeline.py``,
``launch/train_hybrid.py --workers``) and the trainers' Keras-like ``fit``.

The script runs need root (namespaces, cgroups) and are skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests.test_tf_cluster import _leftovers, needs_root

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """Runs ``python -m module args``; the result also carries the process id (``.pid``)."""
    with subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid  # type: ignore[attr-defined]
    return done


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as root here")
def test_train_pipeline_without_root_says_so():
    proc = _run("launch.train_pipeline", "--workers=2", "--steps=1")
    assert proc.returncode == 1 and "needs root" in proc.stderr


@pytest.mark.parametrize("args", [["--micro_batches=3"], ["--plans=fastest"],
                                  ["--spread=1.0"], ["--workers=1"]])
def test_train_pipeline_flags_are_checked(args):
    proc = _run("launch.train_pipeline", *args)
    assert proc.returncode != 0
    flag = args[0].split("=")[0]
    assert flag in proc.stderr


# A 3-worker cluster end to end: `make test-slow`.
@needs_root
@pytest.mark.slow
def test_train_pipeline_trains_every_plan_on_the_cluster(tmp_path):
    proc = _run("launch.train_pipeline", "--workers=3", "--model=cnn_small",
                "--bandwidth_mbit=400", "--steps=2", "--warmup_steps=1", "--batch_size=32",
                "--micro_batches=2", "--profile_repeats=2", f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "pipeline_cluster.json").read_text())
    assert set(rec["plans"]) == {"bandwidth_aware", "pipedream", "oblivious"}
    for plan in rec["plans"].values():
        assert plan["measured_step_s"] > 0 and plan["predicted_step_s"] > 0
        assert plan["throughput_samples_s"] == pytest.approx(32 / plan["measured_step_s"])
        tasks = {t for st in plan["stages"] for t in st["worker_tasks"]}
        assert tasks <= {0, 1, 2}
        assert plan["stages"][0]["layers"][0] == 0
    assert len(rec["pair_mbit"]) == 3 and max(map(max, rec["pair_mbit"])) == 400
    assert set(rec["speedup"]) == {"bandwidth_aware_over_pipedream",
                                   "bandwidth_aware_over_oblivious"}


HYBRID = ["--workers=2+1", "--model=vgg_fc", "--dataset=digits", "--fc_units=2048",
          "--steps=3", "--batch_size=32", "--conv_worker_memory_mib=900"]


@needs_root
@pytest.mark.slow
def test_train_hybrid_on_workers_matches_data_parallel(tmp_path):
    """``launch.train_hybrid --workers=2+1``: the FC state on its own worker, the weights
    those of data-parallel training.

    Slow (four TensorFlow processes): the default suite keeps the same placement across worker
    processes (``tests/test_tf_cluster.py``, the hybrid test), the script on logical devices
    (``tests/test_hybrid.py``) and this launcher's refusal of a capped conv worker (below)."""
    proc = _run("launch.train_hybrid", *HYBRID, "--verify_against_data_parallel",
                f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "hybrid_cluster.json").read_text())
    assert rec["max_abs_weight_diff"] < 1e-4
    assert rec["fc_state_task"] == 2 and rec["conv_tasks"] == [0, 1]
    devices = rec["variable_bytes_by_device"]
    fc = devices["/job:worker/replica:0/task:2/device:CPU:0"]
    assert rec["fc_state_bytes"] == fc and fc > 2048 * 2048 * 4 * 2  # weights + momentum
    assert all(devices[f"/job:worker/replica:0/task:{t}/device:CPU:0"] < fc / 10
               for t in (0, 1))
    assert len(rec["conv_worker_idle_bytes"]) == 2
    assert all(0 < b < 900 * 2**20 for b in rec["conv_worker_idle_bytes"])


# A memory-capped 3-worker cluster end to end: `make test-slow`.
@needs_root
@pytest.mark.slow
def test_train_hybrid_refuses_fc_state_on_a_capped_conv_worker(tmp_path):
    # 8192 units: the planned FC state alone (about 1 GiB) exceeds the cap, whatever the
    # worker's idle footprint (about 620-700 MiB, depending on what TensorFlow imports)
    proc = _run("launch.train_hybrid", *HYBRID, "--fc_state_task=0", "--fc_units=8192",
                "--conv_worker_memory_mib=850", f"--out={tmp_path}")
    assert proc.returncode == 1
    assert "does not fit conv worker 0's memory cap" in proc.stdout + proc.stderr
    assert not (tmp_path / "hybrid_cluster.json").exists()
    assert _leftovers(proc.pid) == []


@needs_root
@pytest.mark.slow
def test_train_hybrid_fc_state_on_a_capped_conv_worker_is_oom_killed(tmp_path):
    proc = _run("launch.train_hybrid", *HYBRID, "--fc_state_task=0", "--fc_units=6144",
                "--dataset=fashion_mnist", "--conv_worker_memory_mib=1000", "--nocheck_memory",
                f"--out={tmp_path}")
    assert proc.returncode == 1
    assert "worker 0" in proc.stderr and "out-of-memory killer" in proc.stderr


# ------------------------------------------------------------------ fit
def _chain() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 1)),
                             keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
                             keras.layers.Flatten(name="flatten"),
                             keras.layers.Dense(8, activation="relu", name="fc1"),
                             keras.layers.Dense(3, name="logits")])


def _dataset(n: int = 48, batch: int = 12) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6, 6, 1)).astype("float32")
    y = (x[:, 0, 0, 0] > 0).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def _trainers() -> dict:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return {
        "pipeline": lambda: tfbs.PipelineTrainer(_chain(), [(0, 1, [0]), (2, 3, [1])], loss,
                                                 keras.optimizers.SGD(0.1), 2),
        "hybrid": lambda: tfbs.HybridTrainer(_chain(), ["/cpu:0", "/cpu:1"], ["/cpu:1"],
                                             keras.optimizers.SGD(0.1), loss),
    }


@pytest.mark.parametrize("kind", ["pipeline", "hybrid"])
def test_fit_runs_callbacks_like_keras(kind, tmp_path):
    trainer = _trainers()[kind]()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(("batch", batch, logs["loss"]))

        def on_epoch_end(self, epoch, logs=None):
            seen.append(("epoch", epoch, logs["loss"]))

    history = trainer.fit(_dataset(), epochs=2, verbose=0,
                          callbacks=[Record(), keras.callbacks.TensorBoard(str(tmp_path))])
    batches = [s for s in seen if s[0] == "batch"]
    epochs = [s for s in seen if s[0] == "epoch"]
    assert [b[1] for b in batches] == [0, 1, 2, 3] * 2
    assert len(epochs) == 2
    assert history.history["loss"] == pytest.approx(
        [np.mean([b[2] for b in batches[:4]]), np.mean([b[2] for b in batches[4:]])])
    assert history.history["loss"][1] < history.history["loss"][0]
    assert (tmp_path / "train").is_dir()
    # the Keras model holds the trained weights after every epoch
    rep = trainer.replicas[0][0] if kind == "pipeline" else trainer.replicas["conv"][0]
    np.testing.assert_array_equal(trainer.model.trainable_variables[0].numpy(),
                                  rep.trainable[0].numpy())


def test_fit_stops_with_early_stopping_and_steps_per_epoch():
    trainer = _trainers()["pipeline"]()
    stopper = keras.callbacks.EarlyStopping("loss", patience=0, min_delta=10.0)
    history = trainer.fit(_dataset().repeat(), epochs=5, steps_per_epoch=2, verbose=0,
                          callbacks=[stopper])
    assert len(history.history["loss"]) == 2  # stopped after the first epoch without progress


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"epochs": 0}, "epochs"), ({"steps_per_epoch": 0}, "steps_per_epoch"),
    ({"verbose": 3}, "verbose"), ({"initial_epoch": -1}, "initial_epoch")])
def test_fit_checks_its_arguments(kwargs, match):
    trainer = _trainers()["pipeline"]()
    with pytest.raises(ValueError, match=match):
        trainer.fit(_dataset(), **kwargs)
