"""Real 2-process MultiWorkerMirroredStrategy model.fit on localhost (the scenarios of
``tests/mwms_worker.py``, one launch for the session: ``mwms_runs`` in conftest)."""

import json

import numpy as np
import pytest

from tf_blocksparse.options import EXCHANGES


# Both modes and both ways of treating small variables, across processes (every pairing of
# them is compared with the NumPy references in one process).
@pytest.mark.parametrize("exchange,dense_below", [("allgather", 0), ("shared", 100)])
def test_two_process_fit_trains_and_stays_in_sync(mwms_runs, exchange, dense_below):
    tmp_path = mwms_runs / f"{exchange}-{dense_below}"
    w0, w1 = (np.load(tmp_path / f"weights_{i}.npz") for i in range(2))
    for key in w0.files:
        assert np.array_equal(w0[key], w1[key]), key
    h0 = json.loads((tmp_path / "history_0.json").read_text())
    assert h0["replicas"] == 2
    assert h0["loss"][-1] < h0["loss"][0], h0["loss"]
    assert h0["metrics"]["blocks_kept"] == (8 + 8 + 1 + 2 if dense_below else 4)
    # conv 3x3x1x8 (+8 bias), dense 288x2 (+2 bias): one block of each per worker; with
    # dense_below=100 all but the dense kernel go whole (one dense sum, no ids or scores).
    if dense_below:
        side = 4 * (1 + 1) if exchange == "allgather" else 4 * 2  # id + flag | 2 scores
        values = 4 * (288 + 72 + 8 + 2)
    else:
        side = 4 * 5 if exchange == "allgather" else 4 * (8 + 8 + 2 + 2)
        values = 4 * (9 + 1 + 288 + 1)
    assert h0["metrics"]["payload_bytes"] == values + side
    assert h0["metrics"]["dense_bytes"] == 4 * (72 + 8 + 576 + 2)


def test_two_process_auto_exchange_decides_the_same_everywhere(mwms_runs):
    """exchange="auto" under MWMS: the build-time probe and two re-decisions run collectives
    on both workers, which take the same decisions and stay in sync, also through forced
    switches to sparse and back to dense (the state moves with collectives)."""
    tmp_path = mwms_runs / "auto-0"
    w0, w1 = (np.load(tmp_path / f"weights_{i}.npz") for i in range(2))
    for key in w0.files:
        assert np.array_equal(w0[key], w1[key]), key
    h0, h1 = (json.loads((tmp_path / f"history_{i}.json").read_text()) for i in range(2))
    assert h0["loss"][-1] < h0["loss"][0], h0["loss"]
    assert [d[0] for d in h0["decisions"]] == [3, 13, 23]
    assert h0["decisions"] == h1["decisions"]
    assert all(m in EXCHANGES for _, ms in h0["decisions"]
               for m in ms)
    assert len(h0["decisions"][0][1]) >= 2  # the fusion buffer makes several groups
    assert h0["flushed_residuals"] == 0.0  # the last switch (to dense) flushed every one
    for key in ("auto_sum_latency_ms", "auto_compute_ms", "auto_predicted_step_ms"):
        assert h0["metrics"][key] == h1["metrics"][key], key
