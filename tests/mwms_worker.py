"""One worker of the 2-process MultiWorkerMirroredStrategy tests (reads TF_CONFIG).

Usage: python tests/mwms_worker.py OUT_DIR SCENARIO [SCENARIO ...], a scenario being
EXCHANGE or EXCHANGE:DENSE_BELOW (a fit with that exchange: ``weights_<task>.npz`` and
``history_<task>.json`` in ``OUT_DIR/<EXCHANGE>-<DENSE_BELOW>``) or the name of another
worker script's test in :data:`OTHER_SCENARIOS` (its files in ``OUT_DIR/<name>``).  One
strategy serves every scenario (in turn), so the tests share one launch (``tests/conftest.py``
``mwms_runs``); it is made with the dtype test's heartbeat timeout.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_blocksparse as tfbs  # noqa: E402
from tests import (  # noqa: E402
    batch_count_worker,
    eval_worker,
    mwms_accumulation_worker,
    mwms_dtype_worker,
    mwms_mixed_precision_worker,
)

#: Scenarios run by the other worker scripts' ``run(strategy, out_dir)``.
OTHER_SCENARIOS = {"dtypes": mwms_dtype_worker.run,
                   "accumulation": mwms_accumulation_worker.run,
                   "evaluation": eval_worker.run,
                   "batch_count": batch_count_worker.run,
                   "mixed_precision": mwms_mixed_precision_worker.run}


def scenario_dir(out_dir: str, exchange: str, dense_below: int = 0) -> str:
    """Where a scenario's files go."""
    return os.path.join(out_dir, f"{exchange}-{dense_below}")


def main(out_dir: str, scenarios: list[str]) -> None:
    strategy = tfbs.MultiWorkerMirroredStrategy(
        heartbeat_timeout_s=mwms_dtype_worker.HEARTBEAT_TIMEOUT_S)
    for scenario in scenarios:
        if scenario in OTHER_SCENARIOS:
            folder = os.path.join(out_dir, scenario)
            os.makedirs(folder, exist_ok=True)
            OTHER_SCENARIOS[scenario](strategy, folder)
        else:
            exchange, _, below = scenario.partition(":")
            run(strategy, scenario_dir(out_dir, exchange, int(below or 0)), exchange,
                int(below or 0))


def run(strategy: tf.distribute.Strategy, out_dir: str, exchange: str, dense_below: int
        ) -> None:
    os.makedirs(out_dir, exist_ok=True)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8, 8, 1)).astype("float32")
    y = (x[:, :4, :4, 0].mean(axis=(1, 2)) > 0).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(2)])
        extra = {}
        if exchange == "auto":  # several groups, re-decided twice during the run
            exchange = tfbs.AutoExchange(warmup_steps=3, remeasure_steps=10,
                                          measure_budget=None)
            extra["fusion_buffer_bytes"] = 1024
        opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), k=1,
                                        exchange=exchange, dense_below=dense_below, **extra)
        model.compile(optimizer=opt, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    auto = tfbs.AutoExchangeCallback()
    hist = model.fit(ds, epochs=4, verbose=0, callbacks=[auto])
    metrics = opt.block_sparse_metrics()  # a collective: every worker reads it
    flushed = None
    if opt.exchange_chooser is not None:  # forced switches both ways move the state
        chooser = opt.exchange_chooser   # (collectives on every worker)
        for mode in ("allgather", "dense"):
            chooser.set_modes([mode] * len(chooser.groups))
            model.make_train_function(force=True)
            model.fit(ds, epochs=1, verbose=0)
        flushed = float(sum(np.abs(r.numpy()).sum() for r in opt.residuals))
    decisions = [[step, list(d.modes)] for step, d in auto.decisions]
    np.savez(os.path.join(out_dir, f"weights_{task}.npz"), *model.get_weights())
    with open(os.path.join(out_dir, f"history_{task}.json"), "w") as f:
        json.dump({"loss": hist.history["loss"], "metrics": metrics, "decisions": decisions,
                   "flushed_residuals": flushed, "replicas": strategy.num_replicas_in_sync}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
