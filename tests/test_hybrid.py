"""Hybrid conv/FC training: split, equivalence, host placement, block-sparse groups,
per-layer sync dependencies, launch scripts.

In-process tests use the two logical CPUs of ``conftest.py`` (replicas may share a device); the
launch-script tests run subprocesses that configure more logical CPUs before TF starts.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from launch.hybrid_setup import train_data_parallel
from models.vgg import vgg_fc
from tf_blocksparse.hybrid import MemoryBudget, evaluate_placement, plan_placement
from tf_blocksparse.hybrid.split import find_boundary, layer_memory, split_model
from tf_blocksparse.hybrid.sync import ancestors, gradient_dependencies
from tf_blocksparse.hybrid.trainer import HybridTrainer

ROOT = Path(__file__).resolve().parents[1]
CPUS = ["/cpu:0", "/cpu:1"]


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.05, momentum=0.9)


def _vgg(seed: int = 0) -> keras.Model:
    # 8x8 input: conv1_1, conv1_2, pool1, conv2_1, conv2_2, pool2, flatten | fc1, fc2, logits
    return vgg_fc((8, 8, 1), 10, fc_units=32, seed=seed)


def _batches(steps: int, batch: int = 12) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((batch, 8, 8, 1)).astype("float32"),
             rng.integers(0, 10, batch).astype("int32")) for _ in range(steps)]


def _plain(model: keras.Model, batches: list) -> list[float]:
    """Single-device full-batch SGD with momentum; returns the losses."""
    opt, losses = _sgd(), []
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = _loss()(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    return losses


@functools.cache
def _plain_run(steps: int, batch: int) -> tuple[tuple[float, ...], tuple[np.ndarray, ...]]:
    """:func:`_plain` on a fresh ``_vgg()`` and ``_batches(steps, batch)``: the losses and the
    trained weights (NumPy, computed once per module: the tests only read them)."""
    model = _vgg()
    losses = _plain(model, _batches(steps, batch))
    return tuple(losses), tuple(model.get_weights())


def _max_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def _functional() -> keras.Model:
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 8, 2))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(inp)
    m = keras.layers.Dense(4, name="mix")(a)  # a Dense inside the trunk, before the last conv
    b = keras.layers.Conv2D(4, 3, padding="same", name="c2")(m)
    s = keras.layers.Add(name="add")([a, b])  # a skip connection around mix and c2
    g = keras.layers.GlobalAveragePooling2D(name="gap")(s)
    d = keras.layers.Dense(6, activation="relu", name="d1")(g)
    return keras.Model(inp, keras.layers.Dense(3, name="d2")(d), name="functional_cnn")


# ----------------------------------------------------------------------------- the split


def test_boundary_of_vgg_fc() -> None:
    model = _vgg()
    b = find_boundary(model)
    assert (b.head_layer, b.producer, b.last_conv) == ("fc1", "flatten", "conv2_2")
    trunk, head = split_model(model, b)
    own = [layer.name for layer in trunk.layers[1:]]
    assert own == ["conv1_1", "conv1_2", "pool1", "conv2_1", "conv2_2", "pool2", "flatten"]
    assert [layer.name for layer in head.layers[1:]] == ["fc1", "fc2", "logits"]
    assert head.get_layer("fc1") is model.get_layer("fc1")  # shared layer objects
    x = _batches(1)[0][0]
    np.testing.assert_allclose(head(trunk(x)), model(x), rtol=1e-6, atol=1e-6)
    named = find_boundary(model, "conv2_2")  # the last conv layer joins the head
    assert named.producer == "conv2_1"
    assert [layer.name for layer in split_model(model, "conv2_2")[1].layers[1:]] == \
        ["conv2_2", "pool2", "flatten", "fc1", "fc2", "logits"]


def test_boundary_of_functional_model() -> None:
    model = _functional()
    b = find_boundary(model)  # "mix" is a Dense before the last conv: not the boundary
    assert (b.head_layer, b.producer, b.last_conv) == ("d1", "gap", "c2")
    trunk, head = split_model(model)
    assert {layer.name for layer in trunk.layers[1:]} == {"c1", "mix", "c2", "add", "gap"}
    x = np.random.default_rng(0).standard_normal((3, 8, 8, 2)).astype("float32")
    np.testing.assert_allclose(head(trunk(x)), model(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not a cut"):
        split_model(model, "c2")  # the skip connection from c1 crosses the cut
    with pytest.raises(ValueError, match="one input"):
        find_boundary(model, "add")
    with pytest.raises(ValueError, match="layer_name"):
        find_boundary(model, "nope")
    mlp = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="no convolution"):
        find_boundary(mlp)


# ------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("conv,fc,boundary,batch", [
    (CPUS, ["/cpu:1"], None, 12),                 # I=2 > J=1: both A replicas feed B 0
    (["/cpu:0"], CPUS, None, 12),                 # I=1 < J=2: A's rows split over B
    (CPUS + ["/cpu:0"], CPUS, "conv2_2", 13),     # I=3, J=2, uneven rows, named split
])
def test_matches_plain_training(conv: list, fc: list, boundary: str | None, batch: int) -> None:
    model = _vgg()
    trainer = HybridTrainer(model, conv, fc, _sgd(), _loss(), boundary=boundary,
                            host_device="/cpu:1")
    want, plain = _plain_run(3, batch)
    got = [float(trainer.train_step(x, y)) for x, y in _batches(3, batch)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    trainer.copy_to_model()
    assert _max_diff(model.get_weights(), plain) < 1e-5
    for group in ("conv", "fc"):  # the replicas of a group stay identical
        first, *others = trainer.replicas[group]
        for rep in others:
            for a, b in zip(first.trainable, rep.trainable):
                np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_matches_data_parallel_reference(mirrored2: tf.distribute.Strategy) -> None:
    model = _vgg()
    initial = model.get_weights()
    batches = _batches(3)
    trainer = HybridTrainer(model, CPUS, ["/cpu:1"], _sgd(), _loss(), host_device="/cpu:0")
    for x, y in batches:
        trainer.train_step(x, y)
    trainer.copy_to_model()
    want = train_data_parallel(_vgg, initial, batches, CPUS, 0.05, 0.9, strategy=mirrored2)
    assert _max_diff(model.get_weights(), want) < 1e-5


# --------------------------------------------------------------------- host placement


def _devices(mapping: dict) -> set[str]:
    return {d.rsplit("device:", 1)[-1] for d in mapping.values()}


def test_offloaded_state_lives_on_the_host_device() -> None:
    trainer = HybridTrainer(_vgg(), ["/cpu:0"], ["/cpu:0"], _sgd(), _loss(),
                            host_device="/cpu:1")
    p = trainer.placement()
    assert p["expanded_layers"] == ["fc1", "fc2", "logits"]
    (fc,), (conv,) = p["fc"], p["conv"]
    assert _devices(fc["variables"]) == {"CPU:1"}
    assert _devices(fc["optimizer_slots"]) == {"CPU:1"}
    assert _devices(conv["variables"]) == _devices(conv["optimizer_slots"]) == {"CPU:0"}
    fc1 = trainer.replicas["fc"][0].trainable[0]
    assert "CPU:1" in fc1.value.device
    before = fc1.numpy().copy()
    trainer.train_step(*_batches(1)[0])
    assert np.any(fc1.numpy() != before)  # trained where it lives
    none = HybridTrainer(_vgg(), ["/cpu:0"], ["/cpu:0"], _sgd(), _loss(),
                         host_device="/cpu:1", offload="none")
    assert _devices(none.placement()["fc"][0]["variables"]) == {"CPU:0"}


def test_planner_drives_the_placement() -> None:
    model = vgg_fc((8, 8, 1), 10, fc_units=256, seed=0)  # the head outweighs the trunk
    layers = layer_memory(model, None, 12, _sgd())
    assert [x.name for x in layers if x.is_fc] == ["fc1", "fc2", "logits"]
    fc1 = model.get_layer("fc1")
    row = next(x for x in layers if x.name == "fc1")
    assert row.param_bytes == (fc1.kernel.shape[0] * 256 + 256) * 4
    assert row.optimizer_state_bytes == row.param_bytes  # momentum: one slot
    assert row.activation_bytes == 12 * 256 * 4
    adam = layer_memory(model, None, 12, keras.optimizers.Adam())
    assert next(x for x in adam if x.name == "fc1").optimizer_state_bytes == 2 * row.param_bytes
    on_device = evaluate_placement(layers, [], MemoryBudget(1e12, 1e12, 1e9, 1e9))
    budget = on_device.group_bytes["conv"]["device"]  # the trunk fits, the head does not
    assert on_device.group_bytes["fc"]["device"] > budget
    plan = plan_placement(layers, budget, float("inf"), 1e9, 1e9)
    assert plan.expanded_layers == ("fc1", "fc2") and plan.fits
    trainer = HybridTrainer(model, ["/cpu:0"], ["/cpu:0"], _sgd(), _loss(),
                            host_device="/cpu:1", offload=plan)
    fc = trainer.placement()["fc"][0]["variables"]
    for path, device in fc.items():
        layer = path.split("/")[-2]
        assert ("CPU:1" in device) == (layer in plan.expanded_layers), (path, device)


# --------------------------------------------------------------------- block-sparse


def test_block_sparse_inside_groups() -> None:
    # the uncompressed trainer on these devices trains as the plain run (to 1e-5:
    # test_matches_plain_training's first case), so that run stands for it
    sparse = _vgg()
    trainer = HybridTrainer(sparse, CPUS, ["/cpu:1"], _sgd(), _loss(), compression={"k": 1})
    for x, y in _batches(3):
        trainer.train_step(x, y)
    trainer.copy_to_model()
    assert _max_diff(_plain_run(3, 12)[1], sparse.get_weights()) > 1e-4
    for group in ("conv", "fc"):
        sizes = trainer.syncs[group].nbytes()
        assert sizes["payload"] < sizes["dense"]
        assert any(np.any(r.numpy() != 0) for r in trainer.syncs[group].residuals[0])
    # one FC row (a Dense kernel's column: one unit's incoming weights) is one block
    fc1 = trainer.replicas["fc"][0].trainable_refs[0]
    assert trainer.syncs["fc"].layouts[0].num_blocks == fc1.shape[-1]
    only_fc = HybridTrainer(_vgg(), CPUS, ["/cpu:1"], _sgd(), _loss(),
                            compression={"fc": {"density": 0.1, "metric": "l2"}})
    assert only_fc.syncs["conv"].compression is None and not only_fc.syncs["conv"].residuals
    assert only_fc.syncs["fc"].compression.metric == "l2"


def test_block_sparse_matches_block_sparse_data_parallel() -> None:
    model = _vgg()
    initial, batches, spec = model.get_weights(), _batches(3), {"k": 2}
    trainer = HybridTrainer(model, CPUS, CPUS, _sgd(), _loss(), compression=spec)
    for x, y in batches:
        trainer.train_step(x, y)
    trainer.copy_to_model()
    want = train_data_parallel(_vgg, initial, batches, CPUS, 0.05, 0.9, spec)
    assert _max_diff(model.get_weights(), want) < 1e-5


# ------------------------------------------------------------ per-layer sync overlap


@pytest.mark.parametrize("compression", [None, {"k": 1}])
def test_each_conv_gradient_is_reduced_as_soon_as_ready(compression: dict | None) -> None:
    trainer = HybridTrainer(_vgg(), CPUS, ["/cpu:1"], _sgd(), _loss(), compression=compression)
    x, y = _batches(1)[0]
    assert all(not deps for deps in trainer.sync_dependencies(x, y, "conv").values())
    record = trainer.trace_step(x, y)  # what sync_dependencies traces, for the FC group too
    fc_paths = [v.path for v in trainer.replicas["fc"][0].trainable_refs]
    fc_deps = gradient_dependencies(record["grads"]["fc"], record["totals"]["fc"], fc_paths)
    assert len(fc_deps) == 6 and all(not deps for deps in fc_deps.values())
    paths = [v.path for v in trainer.replicas["conv"][0].trainable_refs]
    first, last = paths.index("vgg_fc/conv1_1/kernel"), paths.index("vgg_fc/conv2_2/kernel")
    grads, totals = record["grads"]["conv"], record["totals"]["conv"]
    first_grad_ops = {g[first].op.name for g in grads}
    assert first_grad_ops <= ancestors(totals[first].op)  # non-vacuous: its own sum needs it
    # the last conv layer's reduce does not wait for the first conv layer's gradient ...
    assert not first_grad_ops & ancestors(totals[last].op)
    # ... and backward down to the first layer does not wait for that reduce
    for g in grads:
        assert totals[last].op.name not in ancestors(g[first].op)
    # the last conv layer's update (one optimizer per layer) does not wait either
    rep = trainer.replicas["conv"][0]
    handle = {internal.name for ext, internal in record["graph"].captures
              if ext is rep.trainable[last].value.handle}
    updates = [op for op in record["graph"].get_operations()
               if op.type.startswith("Assign") and op.inputs[0].name in handle]
    assert updates
    assert all(not first_grad_ops & ancestors(op) for op in updates)


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    ({"conv_devices": "/cpu:0"}, "conv_devices"),
    ({"fc_devices": ["/cpu:7"]}, "fc_devices"),
    ({"host_device": "/gpu:5"}, "host_device"),
    ({"compression": {"k": 0}}, "compression"),
    ({"compression": {"conv": {"q": 1}}}, r"compression\['conv'\]"),
    ({"offload": "all"}, "offload"),
    ({"offload": ["nope"]}, "offload"),
    ({"boundary": "nope"}, "layer_name"),
    ({"loss": 3}, "loss"),
    ({"optimizer": "sgd"}, "optimizer"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"conv_devices": CPUS, "fc_devices": ["/cpu:1"], "optimizer": _sgd(),
            "loss": _loss(), **kwargs}
    with pytest.raises(ValueError, match=match):
        HybridTrainer(_vgg(), **args)


def test_batch_smaller_than_replicas() -> None:
    trainer = HybridTrainer(_vgg(), CPUS + CPUS, ["/cpu:1"], _sgd(), _loss())
    x, y = _batches(1, batch=3)[0]
    with pytest.raises(ValueError, match="batch size"):
        trainer.train_step(x, y)


# -------------------------------------------------------------------- launch scripts


def _run_script(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The script end to end (several processes): `make test-slow`.
@pytest.mark.slow
def test_train_hybrid_verifies_against_data_parallel() -> None:
    r = _run_script("launch.train_hybrid", "--dataset=digits", "--conv_replicas=3",
                    "--fc_replicas=2", "--steps=2", "--batch_size=15", "--fc_units=32",
                    "--offload=fc", "--verify_against_data_parallel")
    assert r["max_abs_weight_diff"] < 1e-5
    placement = r["memory_placement"]
    assert placement["conv"]["variable_devices"] == ["CPU:0", "CPU:1", "CPU:2"]
    assert placement["fc"]["compute_devices"] == ["/cpu:3", "/cpu:4"]
    assert placement["fc"]["variable_devices"] == ["CPU:5"]  # the host device
    assert placement["fc"]["optimizer_state_devices"] == ["CPU:5"]


@pytest.mark.slow
def test_bench_hybrid_offloads_the_head() -> None:
    """The benchmark script end to end (slow: three trainings); the default suite keeps its
    parts: the planner, the placement and the trainer above."""
    r = _run_script("launch.bench_hybrid", "--image_size=8", "--fc_units=256", "--batch=8",
                    "--device_memory_budget=1.2", "--steps=1", "--warmup_steps=1",
                    "--profile_repeats=1")
    assert not r["all_on_device_fits_budget"] and r["plan"]["fits"]
    assert set(r["runs"]) == {"offloaded", "all_on_device", "offloaded_block_sparse"}
    off = r["runs"]["offloaded"]
    assert off["expanded_layers"] and off["fits_budget"]
    assert "CPU:3" in off["fc_variable_devices"]  # the host device of 2 + 1 replicas
    assert r["runs"]["all_on_device"]["fc_variable_devices"] == ["CPU:2"]
    assert off["step_time_s"] > 0 and r["memory_source"]
