"""Pipeline runtime (PipelineTrainer) and the layer profiler that feeds the planner.

The in-process tests run on the two logical CPUs of ``conftest.py``; the layouts that need
three or four devices reuse a logical CPU (``allow_device_reuse=True``), and one test runs a
four-stage-device layout with distinct devices in a subprocess that configures four logical
CPUs before TensorFlow starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from models.cnn import cnn_small
from tf_blocksparse.pipeline.profiler import chain_layers, measure_layers, profile_model
from tf_blocksparse.pipeline.trainer import PipelineTrainer
from tf_blocksparse.planning import Topology, plan_pipeline

ROOT = Path(__file__).resolve().parents[1]
BATCH = 12
CPUS = ["/cpu:0", "/cpu:1"]  # explicit: on a GPU host the default devices are the GPUs


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(seed: int = 0) -> keras.Model:
    # 8x8 input: conv1, conv2, pool2, flatten, fc1, logits (6 layers)
    return cnn_small((8, 8, 1), 10, seed=seed)


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH, 8, 8, 1)).astype("float32"),
            rng.integers(0, 10, BATCH).astype("int32"))


def _reference_gradients(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list:
    with tf.GradientTape() as tape:
        loss = _loss()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages,micro_batches", [
    ([(0, 2, [0]), (3, 5, [1])], 4),
    ([(0, 2, [0]), (3, 5, [1])], 1),
    ([(0, 1, ["/cpu:0", "/cpu:1"]), (2, 5, ["/cpu:0"])], 4),      # 3-row micro-batches: 2 + 1
    ([(0, 0, [0]), (1, 3, [1, 0]), (4, 5, [1])], 4),               # replicated middle stage
])
def test_gradients_match_full_batch(stages: list, micro_batches: int) -> None:
    model = _model()
    x, y = _batch()
    trainer = PipelineTrainer(model, stages, _loss(), keras.optimizers.SGD(0.1), micro_batches,
                              CPUS, allow_device_reuse=True)
    _assert_close(trainer.compute_gradients(x, y), _reference_gradients(model, x, y))


def test_train_steps_match_plain_sgd() -> None:
    model, plain = _model(seed=1), _model(seed=1)
    plain.set_weights(model.get_weights())
    trainer = PipelineTrainer(model, [(0, 1, [0, 1]), (2, 5, [1])], _loss(),
                              keras.optimizers.SGD(0.05, momentum=0.9), micro_batches=2,
                              devices=CPUS, allow_device_reuse=True)
    initial = model.get_weights()
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    for step in range(3):
        x, y = _batch(seed=step)
        with tf.GradientTape() as tape:
            want = _loss()(y, plain(x, training=True))
        opt.apply_gradients(zip(tape.gradient(want, plain.trainable_variables),
                                plain.trainable_variables))
        np.testing.assert_allclose(float(trainer.train_step(x, y)), float(want), rtol=1e-5)
    first, second = trainer.replicas[0]
    for a, b in zip(first.trainable, second.trainable):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # replicas stay identical
    assert "CPU:1" in second.trainable[0].value.device
    _assert_close(model.get_weights(), initial)  # the replicas own copies, not the model's
    trainer.copy_to_model()
    _assert_close(model.get_weights(), plain.get_weights())


def test_planner_plan_runs() -> None:
    model = _model()
    profile = profile_model(model, batch_size=BATCH // 2, warmup=0, repeats=1)
    plan = plan_pipeline(profile, Topology.homogeneous(2, 1e9))
    trainer = PipelineTrainer(model, plan.stages, _loss(), keras.optimizers.SGD(0.1), 2, CPUS)
    x, y = _batch()
    _assert_close(trainer.compute_gradients(x, y), _reference_gradients(model, x, y))


_FOUR_DEVICES = textwrap.dedent("""
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    import keras, numpy as np
    from models.cnn import cnn_small
    from tf_blocksparse.pipeline.trainer import PipelineTrainer
    model = cnn_small((8, 8, 1), 10, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        ref = tape.gradient(loss(y, model(x)), model.trainable_variables)
    trainer = PipelineTrainer(model, [(0, 1, [0]), (2, 4, [1, 2]), (5, 5, [3])], loss,
                              keras.optimizers.SGD(0.1), micro_batches=4,
                              devices=[f"/cpu:{i}" for i in range(4)])
    got = trainer.compute_gradients(x, y)
    close = all(np.allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)
                for g, r in zip(got, ref))
    devices = [rep.trainable[0].value.device for reps in trainer.replicas for rep in reps]
    print(json.dumps({"close": close, "devices": devices}))
""")


def test_four_distinct_devices_in_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _FOUR_DEVICES], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["close"]
    # conv1+conv2 | pool2, flatten, fc1 on two replicas | logits: variables on CPU:0..3
    assert [d.rsplit(":", 1)[-1] for d in result["devices"]] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("stages,match", [
    ([(0, 2, [0]), (4, 5, [1])], "stages"),          # gap
    ([(0, 2, [0]), (2, 5, [1])], "stages"),          # overlap
    ([(0, 2, [0]), (3, 4, [1])], "stages"),          # last layer missing
    ([(0, 2, [0]), (3, 5, [])], "stages"),           # no device
    ([(0, 2, [0]), (3, 5, [7])], "stages"),          # id out of range
    ([(0, 2, [0]), (3, 5, [0])], "reused"),          # device reused across stages
    ([(0, 5, ["/cpu:1", "/device:CPU:1"])], "reused"),  # reused inside a stage
])
def test_bad_stages(stages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        PipelineTrainer(_model(), stages, _loss(), keras.optimizers.SGD(0.1), 2, CPUS)
    assert "stages" in str(err.value)


def test_bad_micro_batches() -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineTrainer(_model(), [(0, 5, [0])], _loss(), keras.optimizers.SGD(0.1), 0, CPUS)
    trainer = PipelineTrainer(_model(), [(0, 2, [0]), (3, 5, [1])], _loss(),
                              keras.optimizers.SGD(0.1), 5, CPUS)
    x, y = _batch()
    with pytest.raises(ValueError, match="micro_batches"):
        trainer.train_step(x, y)
    trainer = PipelineTrainer(_model(), [(0, 5, CPUS)], _loss(), keras.optimizers.SGD(0.1),
                              BATCH, CPUS)  # 1-row micro-batches for 2 replicas
    with pytest.raises(ValueError, match="micro_batches"):
        trainer.compute_gradients(x, y)


def _bn_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])


def test_batchnorm_state() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6)).astype("float32")
    y = rng.integers(0, 3, 8).astype("int32")
    # one micro-batch, one replica per stage: same batch statistics as plain training
    model, plain = _bn_model(), _bn_model()
    trainer = PipelineTrainer(model, [(0, 1, [0]), (2, 2, [1])], _loss(),
                              keras.optimizers.SGD(0.1), 1, CPUS)
    _assert_close(trainer.compute_gradients(x, y), _reference_gradients(plain, x, y))
    trainer.train_step(x, y)  # plain's moving statistics were updated once, above
    trainer.copy_to_model()
    bn, plain_bn = model.layers[1], plain.layers[1]
    _assert_close([bn.moving_mean, bn.moving_variance],
                  [plain_bn.moving_mean, plain_bn.moving_variance])
    # replicated stage: the replicas' statistics are averaged, so they stay identical
    trainer = PipelineTrainer(_bn_model(), [(0, 1, CPUS), (2, 2, [1])], _loss(),
                              keras.optimizers.SGD(0.1), 2, CPUS, allow_device_reuse=True)
    trainer.train_step(x, y)
    first, second = trainer.replicas[0]
    for a, b in zip(first.non_trainable, second.non_trainable):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.any(first.non_trainable[0].numpy() != 0)  # moving mean moved


def test_profile_chain_bytes_and_times() -> None:
    model = cnn_small((16, 16, 3), 10, seed=0)
    batch = 4
    profile = profile_model(model, batch_size=batch, warmup=1, repeats=2,
                            subtract_dispatch=False)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    assert [p.name for p in profile.layers] == [layer.name for layer in layers]
    assert profile.metadata["batch_size"] == batch
    for p, layer in zip(profile.layers, layers):
        assert p.activation_bytes == batch * int(np.prod(layer.output.shape[1:])) * 4
        assert p.param_bytes == sum(int(np.prod(v.shape)) * 4 for v in layer.trainable_weights)
        assert p.compute_s > 0 and 0 < p.forward_s <= p.compute_s
    assert [p.param_bytes > 0 for p in profile.layers] == \
        [True, False, True, False, False, True, True]  # conv, pool, conv, pool, flat, fc, fc


def test_functional_chain_is_a_chain() -> None:
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, name="d2")(keras.layers.Dense(3, name="d1")(inp))
    model = keras.Model(inp, out, name="fchain")
    assert [layer.name for layer in chain_layers(model)] == ["d1", "d2"]
    x = np.ones((4, 4), "float32")
    y = np.zeros(4, "int32")
    trainer = PipelineTrainer(model, [(0, 0, [0]), (1, 1, [1])], _loss(),
                              keras.optimizers.SGD(0.1), 2, CPUS)
    _assert_close(trainer.compute_gradients(x, y), _reference_gradients(model, x, y))


def test_profile_residual_model_live_bytes_and_state() -> None:
    inp = keras.Input((6,))
    a = keras.layers.Dense(5, name="a")(inp)
    b = keras.layers.Dense(5, name="b")(a)
    s = keras.layers.Add(name="add")([a, b])
    n = keras.layers.BatchNormalization(name="bn")(s)
    out = keras.layers.Dense(3, name="c")(n)
    model = keras.Model(inp, out, name="residual")
    with pytest.raises(ValueError, match="residual"):
        chain_layers(model)
    with pytest.raises(ValueError, match="residual"):
        measure_layers(model, batch_size=2)
    before = model.get_layer("bn").moving_mean.numpy().copy()
    got = measure_layers(model, batch_size=2, allow_non_chain=True, warmup=0, repeats=1)
    np.testing.assert_array_equal(model.get_layer("bn").moving_mean.numpy(), before)
    assert [m.name for m in got] == ["a", "b", "add", "bn", "c"]
    row = 2 * 5 * 4  # one [2, 5] float32 tensor
    assert [m.output_bytes for m in got] == [row, row, row, row, 2 * 3 * 4]
    assert [m.activation_bytes for m in got] == [row, 2 * row, row, row, 2 * 3 * 4]
    assert [m.param_bytes for m in got] == [(6 * 5 + 5) * 4, 30 * 4, 0, 10 * 4, 18 * 4]


def test_profile_bad_arguments() -> None:
    model = _model()
    with pytest.raises(ValueError, match="batch_size"):
        profile_model(model)
    with pytest.raises(ValueError, match="repeats"):
        profile_model(model, batch_size=2, repeats=0)
    with pytest.raises(ValueError, match="inputs"):
        profile_model(model, [np.zeros((2, 8, 8, 1)), np.zeros((2, 8, 8, 1))])
