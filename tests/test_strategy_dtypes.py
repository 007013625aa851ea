"""``tfbs.MultiWorkerMirroredStrategy`` with the dtypes TF's collectives do not take: uint8
labels in ``model.fit`` (a real 2-process cluster on localhost), exact reduce and gather."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

from tf_blocksparse.distribute import strategy as strategy_lib


@pytest.mark.parametrize("dtype,supported,wire", [
    ("uint8", strategy_lib.REDUCE_DTYPES, tf.int32),
    ("int16", strategy_lib.REDUCE_DTYPES, tf.int32),
    ("bool", strategy_lib.GATHER_DTYPES, tf.int32),
    ("uint32", strategy_lib.REDUCE_DTYPES, tf.int64),
    ("uint64", strategy_lib.GATHER_DTYPES, tf.int64),
    ("bfloat16", strategy_lib.GATHER_DTYPES, tf.float32),
    ("bfloat16", strategy_lib.REDUCE_DTYPES, None),
    ("int32", strategy_lib.REDUCE_DTYPES, None),
    ("float16", strategy_lib.GATHER_DTYPES, None),
    ("string", strategy_lib.REDUCE_DTYPES, None),
])
def test_wire_dtype(dtype, supported, wire):
    assert strategy_lib.wire_dtype(dtype, supported) == wire


def test_uint8_labels_fit_and_narrow_dtypes_reduce_exactly(mwms_runs):
    """Both workers fit on uint8 labels (Keras reduces the first batch for its symbolic
    build) and agree, with a longer coordination heartbeat timeout than TF's.  Every dtype
    comes back with the numbers of int32 (integers, bool) or float32: as itself, but a MEAN
    of integers as float64, as int32's."""
    tmp_path = mwms_runs / "dtypes"  # tests/mwms_dtype_worker.py
    records = [json.loads((tmp_path / f"dtypes_{i}.json").read_text()) for i in range(2)]
    assert records[0]["weights_sum"] == records[1]["weights_sum"]
    # the strategy ran under the coordination service configured with its heartbeat timeout
    assert [r["heartbeat_timeout_s"] for r in records] == [123.0, 123.0]
    # the chief saved alone and nothing waited; its replica's residuals stand in for the
    # cluster's sum (twice its own: one replica per worker), which one replica loads whole
    import keras

    import tf_blocksparse  # noqa: F401  (registers the optimizer)

    loaded = keras.models.load_model(str(tmp_path / "chief.keras"))
    saved = [float(np.sum(r.numpy())) for r in loaded.optimizer.residuals]
    chief = records[0]["residual_sums"]
    np.testing.assert_allclose(saved, 2 * np.asarray(chief), rtol=1e-6)
    assert any(s != 0 for s in saved)
    assert all(math.isfinite(loss) for loss in records[0]["loss"])
    for record in records:
        values = record["values"]
        # worker 0 holds [0, 3], worker 1 [1, 5]
        assert values["int32"] == {"sum": ["int32", [1, 8]], "mean": ["float64", [0.5, 4]],
                                   "mean0": ["float64", 2.25],
                                   "gather": ["int32", [0, 3, 1, 5]]}
        assert values["float32"] == {"sum": ["float32", [1, 8]], "mean": ["float32", [0.5, 4]],
                                     "mean0": ["float32", 2.25],
                                     "gather": ["float32", [0, 3, 1, 5]]}
        for name in ("uint8", "int8", "uint16", "int16", "uint32", "uint64"):
            assert values[name] == {**values["int32"], "sum": [name, [1, 8]],
                                    "gather": [name, [0, 3, 1, 5]]}, name
        for name in ("bfloat16", "float16"):
            assert values[name] == {key: [name, numbers] for key, (_, numbers)
                                    in values["float32"].items()}, name
        assert values["bool"] == {"sum": ["bool", [1, 1]], "mean": ["float64", [0.5, 1]],
                                  "mean0": ["float64", 0.75], "gather": ["bool", [0, 1, 1, 1]]}


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "10"])
def test_a_bad_heartbeat_timeout_is_named(bad):
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        strategy_lib.MultiWorkerMirroredStrategy(heartbeat_timeout_s=bad)
