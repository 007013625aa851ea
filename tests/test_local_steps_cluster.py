"""Local steps (``--sync_every``) on a real 2-worker ``MultiWorkerMirroredStrategy`` cluster:
the workers train apart inside a window and hold the same weights after every epoch, bytes
per step fall with the window, and a run killed mid-epoch resumes exactly (each worker gets
its own inner momentum back)."""

import concurrent.futures
import json
import os
import sys

import numpy as np
import pytest

from launch.cluster.local import run_local_cluster
from tests.saved_files import final_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
ARGS = [sys.executable, "-m", "launch.train", "--strategy=multiworker", "--dataset=digits",
        "--model=cnn_small", "--batch_size=64", "--epochs=2", "--deterministic",
        "--compression=block", "--density=0.1", "--exchange=allgather", "--sync_every=4"]


# Three 2-worker clusters (about a tenth of the default suite's CPU time): `make test-slow`.
# The default suite covers local steps on MirroredStrategy (tests/test_local_steps.py: one
# local step equals the per-step exchange, windows, synchronised evaluation and saving, and a
# run killed inside a window resuming bit for bit with every replica's own inner momentum)
# and the kill-and-resume of a multi-worker run with its per-worker state files
# (tests/test_train.py).
@pytest.mark.slow
def test_local_steps_train_across_workers_and_resume_exactly(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    # the uninterrupted run and the one killed mid-epoch are independent: launched together,
    # their start-ups overlap
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole_rc = pool.submit(run_local_cluster, [*ARGS, f"--model_dir={whole}"], 2,
                               env=ENV, cwd=ROOT, timeout_s=300)
        broken_rc = pool.submit(run_local_cluster,
                                [*ARGS, f"--model_dir={broken}", "--fail_at_step=30",
                                 "--fail_worker=1"], 2, env=ENV, cwd=ROOT, timeout_s=300,
                                grace_s=3)
        assert whole_rc.result() == 0
        assert broken_rc.result() == 17  # killed inside epoch 2
    m = json.loads((whole / "metrics.json").read_text())
    val = m["history"]["val_accuracy"]
    assert m["test_accuracy"] > 0.5 and len(val) == 2, val
    # 22 steps per epoch: an exchange every 4 steps and one after the epoch's last step
    assert m["syncs"] == 2 * 6 and m["steps"] == 44
    sent, dense = m["payload_bytes_per_step"], m["dense_bytes_per_step"]
    assert 0 < sent * 3 < dense * 0.1 * 2, (sent, dense)  # density 0.1, amortised over ~4
    assert m["flags"]["sync_every"] == 4
    state = broken / "backup" / "replica_state"
    saved = [np.load(state / f"worker_{i}.npz") for i in range(2)]
    meta = json.loads(str(saved[0]["meta"]))
    weights = [k for k, n in enumerate(meta["names"]) if "momentum" not in n
               and "residual" not in n]
    momenta = [k for k, n in enumerate(meta["names"]) if "momentum" in n]
    assert weights and momenta, meta["names"]
    for k in weights:  # backed up after the epoch's exchange: one set of weights
        np.testing.assert_array_equal(saved[0][f"s{k}_r0"], saved[1][f"s{k}_r0"])
    assert any(np.any(saved[0][f"s{k}_r0"] != saved[1][f"s{k}_r0"]) for k in momenta)

    assert run_local_cluster([*ARGS, f"--model_dir={broken}"], 2, env=ENV,
                             timeout_s=300) == 0
    resumed = json.loads((broken / "metrics.json").read_text())
    assert resumed["initial_epoch"] == 1
    assert resumed["test_correct"] == m["test_correct"]
    a, b = final_weights(whole), final_weights(broken)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
