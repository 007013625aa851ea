"""launch/runtime.py and launch/script.py: logical CPUs, timers, the shared script main."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
from absl import flags

from launch import runtime, script

ROOT = Path(__file__).resolve().parents[1]


def test_logical_cpus_is_idempotent_and_checks_its_argument():
    have = len(tf.config.list_logical_devices("CPU"))  # conftest made 2 before TF started
    assert have >= 2
    runtime.logical_cpus(2)  # already there: nothing to do
    runtime.logical_cpus(1)
    with pytest.raises(RuntimeError, match="need 64 logical CPUs"):
        runtime.logical_cpus(64)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="count"):
            runtime.logical_cpus(bad)


def test_logical_cpus_in_a_fresh_process():
    code = ("from launch import runtime; runtime.logical_cpus(3); runtime.logical_cpus(3); "
            "import tensorflow as tf; print(len(tf.config.list_logical_devices('CPU')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "3"


class _Clock:
    def __init__(self, steps):
        self.steps, self.now = list(steps), 0.0

    def __call__(self):
        return self.now


def test_median_seconds_warms_up_then_takes_the_median(monkeypatch):
    clock = _Clock([])
    durations = iter([100.0, 3.0, 1.0, 2.0])  # the first call is the warm-up
    calls = []

    def fn():
        calls.append(1)
        clock.now += next(durations)
        return tf.constant(1.0)

    monkeypatch.setattr(runtime.time, "perf_counter", clock)
    assert runtime.median_seconds(fn, repeats=3, warmup=1) == 2.0
    assert len(calls) == 4
    with pytest.raises(ValueError, match="repeats"):
        runtime.median_seconds(fn, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        runtime.median_seconds(fn, repeats=1, warmup=-1)


def test_interleaved_seconds_alternates_and_drops_the_warmup(monkeypatch):
    clock = _Clock([])
    order = []

    def make(name, dt):
        def fn():
            order.append(name)
            clock.now += dt
        return fn

    monkeypatch.setattr(runtime.time, "perf_counter", clock)
    times = runtime.interleaved_seconds({"a": make("a", 1.0), "b": make("b", 2.0)},
                                        repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}


def test_fetch_and_time_call_wait_for_nested_tensors():
    out = runtime.fetch({"x": [tf.constant(1.0), (tf.constant(2), 3)]})
    assert out == {"x": [1.0, (2, 3)]}
    synced = []
    assert runtime.time_call(lambda: tf.constant(1.0), sync=lambda: synced.append(1)) >= 0
    assert synced == [1]


def test_machine_info_keys():
    info = runtime.machine_info()
    assert set(info) == {"platform", "cpus", "tensorflow", "keras", "logical_cpus", "device"}
    assert info["logical_cpus"] >= 2


def test_own_flags_become_key_flags_of_the_script():
    fv = flags.FlagValues()

    def define():
        flags.DEFINE_integer("alpha", 1, "A.", flag_values=fv)
        flags.DEFINE_string("beta", "b", "B.", flag_values=fv)

    assert script.own_flags(define, fv) == ["alpha", "beta"]
    key = {f.name for f in fv.get_key_flags_for_module(sys.argv[0])}
    assert {"alpha", "beta"} <= key


def test_quiet_logging_unless_verbosity_is_given():
    fv = flags.FlagValues()
    flags.DEFINE_integer("verbosity", 0, "v", flag_values=fv)
    root, tf_logger, absl_logger = (logging.getLogger(n) for n in ("", "tensorflow", "absl"))
    before = [log.level for log in (root, tf_logger, absl_logger)]
    try:
        fv(["prog"])
        root.setLevel(logging.INFO)
        script.quiet_logging(fv)
        assert root.getEffectiveLevel() == logging.WARNING
        assert not logging.getLogger("tensorflow").isEnabledFor(logging.INFO)
        fv(["prog", "--verbosity=0"])
        for log in (root, tf_logger):
            log.setLevel(logging.INFO)
        script.quiet_logging(fv)  # asked for: left alone
        assert root.getEffectiveLevel() == logging.INFO
        assert tf_logger.isEnabledFor(logging.INFO)
    finally:
        for log, level in zip((root, tf_logger, absl_logger), before):
            log.setLevel(level)


def test_progress_line_hides_the_block_sparse_fields_unless_asked():
    from launch.callbacks import BLOCK_SPARSE_FIELDS, format_progress, progress

    logs = {"loss": 0.53125, "accuracy": 0.8125, "val_accuracy": 0.80469,
            **{name: 1234.0 for name in BLOCK_SPARSE_FIELDS}, "payload_bytes": 123456.0}
    line = format_progress(1, 3, 4.12, logs)
    assert line == ("epoch 2/3 - 4.1s - accuracy: 0.8125 - loss: 0.5312 - "
                    "val_accuracy: 0.8047")
    full = format_progress(1, 3, 4.12, logs, block_metrics=True)
    assert full.startswith("epoch 2/3 - 4.1s - accuracy: 0.8125 - blocks_kept: 1234 - ")
    assert all(f"{name}: " in full for name in BLOCK_SPARSE_FIELDS)
    assert "payload_bytes: 123456 " in full + " "
    counts = format_progress(0, 1, 1.0, {"val_correct": 31.0, "val_loss": 2.5, "x": 1.0,
                                         "big": 123456.25})
    assert counts == ("epoch 1/1 - 1.0s - big: 123456 - val_correct: 31 - val_loss: 2.5000 - "
                      "x: 1.0000")

    printed, now = [], [0.0]
    cb = progress(2, timer=lambda: now[0], out=printed.append)
    cb.on_epoch_begin(0)
    now[0] = 2.0
    cb.on_epoch_end(0, {"loss": 1.0, "compression": 5.0})
    assert printed == ["epoch 1/2 - 2.0s - loss: 1.0000"]
