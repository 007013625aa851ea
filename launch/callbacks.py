"""Keras callbacks of ``launch/train.py``: training clock, progress line, early stop, and the
fault-injection hooks its tests use.  Keras is imported inside the factories."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

#: The figures :class:`tf_blocksparse.BlockSparseMetrics` adds to the epoch logs.  They stay
#: in the history (``metrics.json``) and TensorBoard; the progress line shows them only when
#: asked (``--block_metrics``).
BLOCK_SPARSE_FIELDS = ("payload_bytes", "dense_bytes", "compression", "blocks_kept",
                       "residual_norm", "skipped_steps")


def format_progress(epoch: int, epochs: int, seconds: float, logs: Mapping[str, Any],
                    block_metrics: bool = False) -> str:
    """The one line printed after each epoch, e.g.
    ``epoch 2/3 - 4.1s - accuracy: 0.8125 - loss: 0.5312 - val_accuracy: 0.8046``.

    Args:
        epoch: 0-based epoch index.
        epochs: Epochs of the run.
        seconds: Wall seconds of the epoch.
        logs: The epoch logs (metric name -> number).
        block_metrics: Also show :data:`BLOCK_SPARSE_FIELDS`.
    """
    parts = [f"epoch {epoch + 1}/{epochs}", f"{seconds:.1f}s"]
    for name in sorted(logs):
        if name in BLOCK_SPARSE_FIELDS and not block_metrics:
            continue
        parts.append(f"{name}: {_show(logs[name])}")
    return " - ".join(parts)


def _show(value: Any) -> str:
    """Counts (whole numbers >= 2, e.g. ``val_correct``, bytes) as integers, other floats
    with 4 decimals, anything else as is."""
    if not isinstance(value, float):
        return str(value)
    if value.is_integer() and abs(value) >= 2:
        return str(int(value))
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.6g}"


def progress(epochs: int, block_metrics: bool = False,
             timer: Callable[[], float] = time.perf_counter, out: Callable[[str], Any] = print):
    """Callback printing :func:`format_progress` after every epoch (put it last).

    Args:
        epochs: Epochs of the run.
        block_metrics: Also print :data:`BLOCK_SPARSE_FIELDS`.
        timer: Seconds, monotonic (tests pass a fake one).
        out: Where each line goes.
    """
    import keras

    class Progress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._start = timer()

        def on_epoch_end(self, epoch, logs=None):
            line = format_progress(epoch, epochs, timer() - self._start,
                                   {k: _number(v) for k, v in (logs or {}).items()},
                                   block_metrics)
            out(line)

    return Progress()


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def epoch_clock(timer: Callable[[], float] = time.perf_counter,
                before_s: Callable[[], float] | None = None,
                barrier: Callable[[], Any] | None = None):
    """Callback recording, per epoch, the cumulative training seconds.

    Its ``train_s`` list is what time-to-accuracy is measured against: the time from the
    start of each epoch to the end of its last training step (exchange included), plus
    ``before_s()`` (read when training begins) in the first epoch: the seconds a method
    spent before training on work it needs for training (the automatic exchange's
    build-time measurements).  Whatever runs after the last step (an evaluation callback, a
    checkpoint whose per-replica state is read through a collective, ``model.fit``'s own
    validation) is not counted, wherever the clock sits in ``callbacks``.

    Across workers that work ends at different times on each, and the next epoch's first
    step waits for the last worker; ``barrier`` (called at every epoch's start, on every
    worker, before the clock is read: e.g. an all-reduce) starts the clock only once every
    worker has arrived, so that wait is not counted either.

    Args:
        timer: Seconds, monotonic (tests pass a fake one).
        before_s: Seconds to count before the first epoch (``None``: none).
        barrier: Returns once every worker called it (``None``: not waited for).
    """
    import keras

    class EpochClock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.train_s: list[float] = []
            self._spent, self._start, self._last = 0.0, 0.0, None

        def on_train_begin(self, logs=None):
            if before_s is not None and not self.train_s:
                self._spent = float(before_s())

        def on_epoch_begin(self, epoch, logs=None):
            if barrier is not None:  # every worker done with the last epoch's extra work
                barrier()
            self._start, self._last = timer(), None

        def on_train_batch_end(self, batch, logs=None):
            self._last = timer()

        def on_epoch_end(self, epoch, logs=None):
            end = self._last if self._last is not None else timer()
            self._spent += end - self._start
            self.train_s.append(round(self._spent, 3))

    return EpochClock()


def slow_state_writes(seconds: float):
    """Fault injection for tests: a ``BackupAndRestore(write_state=...)`` that writes every
    per-replica state file of a backup ``seconds`` late (as a slow disk would)."""
    import time

    from tf_blocksparse.keras import replica_state

    def slow_write(*args):
        time.sleep(seconds)
        replica_state.write_file(*args)

    return slow_write


def dump_restored(path: str, index: int):
    """Callback saving this worker's local residuals once training (and restore) began."""
    import keras
    import numpy as np

    class Dump(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            opt = self.model.optimizer
            strategy = self.model.distribute_strategy
            local = [strategy.experimental_local_results(r.value)[0].numpy()
                     for r in opt.residuals]
            np.savez(f"{path}.worker_{index}.npz", *local)

    return Dump()


def stop_at_accuracy(target: float, min_epochs: int, key: str = "val_accuracy"):
    """Callback stopping training once ``logs[key] >= target`` after ``min_epochs`` epochs.

    The validation metrics are reduced over all replicas, so every worker of a multi-worker
    cluster sees the same value and stops after the same epoch.
    """
    import keras

    class StopAtAccuracy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            value = (logs or {}).get(key)
            if value is not None and epoch + 1 >= min_epochs and value >= target:
                self.model.stop_training = True

    return StopAtAccuracy()


def fail_at(step: int):
    """Fault injection: a callback that ``os._exit(17)``-s after ``step`` training steps."""
    import keras

    class Fail(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen >= step:
                print(f"fault injection: exiting after {self.seen} steps", flush=True)
                os._exit(17)

    return Fail()


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


def timed(inner: Any, timer: Callable[[], float] = time.perf_counter):
    """``inner`` (a Keras callback) with the seconds its epoch-end and batch-end work takes
    (an evaluation, a backup) summed per epoch in ``seconds_per_epoch``.

    Every hook is forwarded to ``inner`` unchanged.
    """
    import keras

    class Timed(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.seconds_per_epoch: list[float] = []
            self._epoch_s = 0.0

        def set_model(self, model):
            super().set_model(model)
            inner.set_model(model)

        def set_params(self, params):
            super().set_params(params)
            inner.set_params(params)

    def forward(name: str) -> Callable:
        def hook(self, *args, **kwargs):
            start = timer()
            getattr(inner, name)(*args, **kwargs)
            if name in ("on_epoch_end", "on_train_batch_end"):
                self._epoch_s += timer() - start
            if name == "on_epoch_end":
                self.seconds_per_epoch.append(round(self._epoch_s, 3))
                self._epoch_s = 0.0
        return hook

    for name in _HOOKS:
        setattr(Timed, name, forward(name))
    return Timed()


def launch_seconds(env: Mapping[str, str] = os.environ,
                   clock: Callable[[], float] = time.time) -> Callable[[], float]:
    """Seconds since the job was launched: since ``TFBS_LAUNCH_TIME`` (a Unix time the
    launcher sets) when given, else since this call."""
    start = float(env.get("TFBS_LAUNCH_TIME") or clock())
    return lambda: clock() - start


def wall_clock(since_launch: Callable[[], float]):
    """Callback recording, at every epoch's end, the seconds since launch (``epoch_wall_s``)
    and, when training begins, ``start_s``.  Put it after the evaluation and backup
    callbacks: an epoch's time then includes them."""
    import keras

    class WallClock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.start_s: float | None = None
            self.epoch_wall_s: list[float] = []

        def on_train_begin(self, logs=None):
            self.start_s = round(since_launch(), 3)

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_wall_s.append(round(since_launch(), 3))

    return WallClock()
