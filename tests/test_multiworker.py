"""Real 2-process MultiWorkerMirroredStrategy model.fit on localhost."""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cluster(tmp_path, exchange: str, timeout: float = 240) -> None:
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}),
            PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
        log = open(tmp_path / f"worker_{i}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "mwms_worker.py"), str(tmp_path),
             exchange], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for i, (p, _) in enumerate(procs):
            rc = p.wait(timeout=timeout)
            if rc != 0:
                tail = (tmp_path / f"worker_{i}.log").read_text()[-3000:]
                pytest.fail(f"worker {i} exited with {rc}:\n{tail}")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()


@pytest.mark.parametrize("exchange", ["allgather", "shared"])
def test_two_process_fit_trains_and_stays_in_sync(tmp_path, exchange):
    _run_cluster(tmp_path, exchange)
    w0, w1 = (np.load(tmp_path / f"weights_{i}.npz") for i in range(2))
    for key in w0.files:
        assert np.array_equal(w0[key], w1[key]), key
    h0 = json.loads((tmp_path / "history_0.json").read_text())
    assert h0["replicas"] == 2
    assert h0["loss"][-1] < h0["loss"][0], h0["loss"]
    assert h0["metrics"]["blocks_kept"] == 4
    # conv 3x3x1x8 (+8 bias), dense 288x2 (+2 bias): one block of each per worker.
    side = 4 * 5 if exchange == "allgather" else 4 * (8 + 8 + 2 + 2)
    assert h0["metrics"]["payload_bytes"] == 4 * (9 + 1 + 288 + 1) + side
    assert h0["metrics"]["dense_bytes"] == 4 * (72 + 8 + 576 + 2)
