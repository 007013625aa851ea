"""Loss scaling around ``BlockSparseOptimizer`` (``tfbs.LossScaleOptimizer``): a non-finite
step on one replica or worker is skipped on every one, which all lower their loss scale
together; Keras' own class around the wrapper is refused with several replicas."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_blocksparse as tfbs
from tests import mwms_mixed_precision_worker as worker


def test_overflow_on_one_worker_skips_the_step_on_both(mwms_runs):
    """mixed_float16 on a 2-process cluster: worker 1's gradients are inf at one batch.  Both
    workers finish (a hang would end the shared launch with 124), skip that step
    (iterations stand still, the loss scale halves) and end with the same weights."""
    tmp_path = mwms_runs / "mixed_precision"  # tests/mwms_mixed_precision_worker.py
    records = [json.loads((tmp_path / f"mixed_{i}.json").read_text()) for i in range(2)]
    k = worker.POISONED_BATCH
    expected = list(range(1, k + 1)) + list(range(k, worker.BATCHES))
    for record in records:
        assert record["iterations"] == expected, record
        scales = record["scales"]
        assert scales[k] == scales[k - 1] / 2 and scales[k + 1:] == [scales[k]] * (
            worker.BATCHES - k - 1), scales
        assert record["skipped_steps"] == 1.0
        epoch = record["epoch"]  # BlockSparseMetrics: means of the applied steps, a total
        assert epoch["skipped_steps"] == [1.0] and np.isfinite(epoch["residual_norm"]).all()
        assert epoch["payload_bytes"] == [record["payload_bytes"]]  # the same every step
    assert records[0]["scales"] == records[1]["scales"]
    w0, w1 = (np.load(tmp_path / f"mixed_weights_{i}.npz") for i in range(2))
    for key in w0.files:
        assert np.array_equal(w0[key], w1[key]), key
        assert np.isfinite(w0[key]).all(), key


def test_overflow_on_one_replica_skips_the_step_on_both(mirrored2):
    """MirroredStrategy (Keras takes the loss scale's decision in cross-replica context from
    replica 0): replica 1's inf gradient still skips the step and halves the scale."""
    with mirrored2.scope():
        w = keras.Variable(np.ones((4, 4), "float32"))
        opt = tfbs.LossScaleOptimizer(tfbs.BlockSparseOptimizer(
            keras.optimizers.SGD(0.1), k=1, dense_below=0, exchange="allgather"),
            initial_scale=8.0)
        opt.build([w])

    @tf.function
    def step(poison):
        def fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            bad = tf.logical_and(poison, tf.equal(rid, 1))
            g = tf.ones((4, 4)) * tf.where(bad, np.inf, 1.0)
            opt.apply([g], [w])
        mirrored2.run(fn)

    step(tf.constant(False))
    before = [t.numpy() for t in w.value.values]
    step(tf.constant(True))
    assert int(opt.iterations.numpy()) == 1 and float(opt.dynamic_scale.numpy()) == 4.0
    for t, b in zip(w.value.values, before):
        assert np.array_equal(t.numpy(), b)
    assert opt.inner_optimizer.block_sparse_metrics()["skipped_steps"] == 1.0
    step(tf.constant(False))
    assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("scaler", [keras.optimizers.LossScaleOptimizer,
                                    tfbs.LossScaleOptimizer])
def test_no_strategy_overflow_skips_and_counts(scaler):
    """One replica: Keras' local check is every replica's, so either class works (Keras'
    skips before the wrapper sees the step, so only tfbs' counts it in skipped_steps)."""
    w = keras.Variable(np.ones((4, 4), "float32"))
    opt = scaler(tfbs.BlockSparseOptimizer(
        keras.optimizers.SGD(0.1), k=1, dense_below=0, exchange="allgather"),
        initial_scale=8.0)
    opt.apply([tf.fill((4, 4), np.inf)], [w])
    assert np.array_equal(w.numpy(), np.ones((4, 4)))
    assert float(opt.dynamic_scale.numpy()) == 4.0
    counted = 1.0 if scaler is tfbs.LossScaleOptimizer else 0.0
    assert opt.inner_optimizer.block_sparse_metrics()["skipped_steps"] == counted
    opt.apply([tf.ones((4, 4))], [w])
    assert int(opt.iterations.numpy()) == 1


def test_keras_loss_scaling_around_the_wrapper_is_refused_with_several_replicas(mirrored2):
    """``model.compile`` under mixed_float16 wraps the wrapper in Keras' class, whose check
    is local: the first step stops with an error naming tfbs.LossScaleOptimizer, before any
    state changes; given tfbs.LossScaleOptimizer, compile keeps it and the fit trains."""
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for wrap in (lambda o: o, tfbs.LossScaleOptimizer):
            with mirrored2.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                          keras.layers.Dense(2, dtype="float32")])
                opt = tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1), k=1,
                                                dense_below=0, exchange="allgather")
                model.compile(wrap(opt), keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
            if wrap is tfbs.LossScaleOptimizer:
                assert type(model.optimizer) is tfbs.LossScaleOptimizer
                assert opt.loss_scaled_by == "agreed"
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
                assert int(opt.iterations.numpy()) == 2
                continue
            assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
            assert opt.loss_scaled_by == "keras"
            before = [w.numpy() for w in model.weights]
            with pytest.raises(ValueError, match="tfbs.LossScaleOptimizer"):
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            for a, b in zip(before, model.weights):
                np.testing.assert_array_equal(a, b.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_the_agreed_class_saves_and_loads_as_itself(tmp_path):
    opt = tfbs.LossScaleOptimizer(tfbs.BlockSparseOptimizer(keras.optimizers.SGD(0.1)),
                                  initial_scale=64.0)
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is tfbs.LossScaleOptimizer and again.initial_scale == 64.0
    assert isinstance(again.inner_optimizer, tfbs.BlockSparseOptimizer)
    assert again.inner_optimizer.loss_scaled_by == "agreed"
    with pytest.raises(ValueError, match="loss_scale_factor"):
        again.inner_optimizer.loss_scale_factor = 2.0
