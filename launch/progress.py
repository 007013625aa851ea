"""A run's per-epoch figures kept beside its backup, so that a run killed and resumed (in
another process, another day) still reports every epoch.

``launch.train`` backs up to ``MODEL_DIR/backup`` after every epoch and resumes from it, but
Keras' ``History`` of a resumed ``model.fit`` holds only the epochs trained since the resume.
With a model directory and backups the chief also writes ``MODEL_DIR/progress.json`` after
every epoch (after the backup, atomically): the history so far and the per-epoch clocks.  A
resumed run's record (:func:`merge`) prepends the first ``initial_epoch`` saved epochs; the
cumulative clocks (training seconds, seconds since launch) continue from the saved epoch's
value, so a resumed run's clock counts every process's time, start-ups included.  Where the
saved epochs do not cover the resumed ones (a backup from before the file existed, or a
kill between the backup and this file), the record says from which epoch its history holds
(``history_from_epoch``) instead of guessing.

This module is pure Python (no TensorFlow).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["CUMULATIVE", "EPOCH_FIELDS", "PROGRESS_FILE", "merge", "progress_callback",
           "read", "write"]

#: The file in the model directory.
PROGRESS_FILE = "progress.json"
#: The record's per-epoch lists besides the history, in the order they are saved.
EPOCH_FIELDS = ("train_s_per_epoch", "epoch_wall_s", "eval_s_per_epoch", "backup_s_per_epoch")
#: Of those, the ones that count from the start of the run (the others are per epoch).
CUMULATIVE = ("train_s_per_epoch", "epoch_wall_s")


def write(model_dir: str, epochs: int, history: Mapping[str, Sequence[float]],
          fields: Mapping[str, Sequence[float]]) -> None:
    """Writes ``MODEL_DIR/progress.json`` atomically (a temporary file renamed over it).

    Args:
      model_dir: The run's model directory.
      epochs: Epochs trained so far (of the whole run).
      history: Metric name -> its value per epoch so far (every epoch of the run).
      fields: The :data:`EPOCH_FIELDS` lists so far (every epoch of the run).
    """
    doc = {"epochs": int(epochs),
           "history": {k: [float(x) for x in v] for k, v in history.items()},
           **{k: [float(x) for x in fields.get(k, [])] for k in EPOCH_FIELDS}}
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, PROGRESS_FILE)
    with open(path + ".tmp", "w") as fh:
        json.dump(doc, fh)
    os.replace(path + ".tmp", path)


def read(model_dir: str | None) -> dict | None:
    """The saved progress of ``model_dir`` (``None``: no directory or no file)."""
    if not model_dir:
        return None
    path = os.path.join(model_dir, PROGRESS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def merge(saved: Mapping[str, Any] | None, initial_epoch: int,
          history: Mapping[str, Sequence[float]], fields: Mapping[str, Sequence[float]]
          ) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """The whole run's history and per-epoch fields from the saved first ``initial_epoch``
    epochs and this process's (those trained since the resume).

    Returns:
      ``(history, fields, history_from_epoch)``: with saved epochs covering
      ``initial_epoch`` (or no resume), every epoch and 0; else this process's epochs alone
      and ``initial_epoch``.
    """
    history = {k: list(v) for k, v in history.items()}
    fields = {k: list(fields.get(k, [])) for k in EPOCH_FIELDS}
    if initial_epoch == 0:
        return history, fields, 0
    if saved is None or saved.get("epochs", 0) < initial_epoch:
        return history, fields, initial_epoch
    before = {k: list(v[:initial_epoch]) for k, v in saved["history"].items()}
    merged = {k: before.get(k, []) + history.get(k, []) for k in {*before, *history}}
    out = {}
    for k in EPOCH_FIELDS:
        old = list(saved.get(k, [])[:initial_epoch])
        if k in CUMULATIVE and old:
            out[k] = old + [round(old[-1] + x, 3) for x in fields[k]]
        else:
            out[k] = old + fields[k]
    return merged, out, 0


def progress_callback(model_dir: str, fields: Callable[[], Mapping[str, Sequence[float]]],
                      initial_epoch: Callable[[Any], int], saved: Mapping[str, Any] | None):
    """A Keras callback writing ``MODEL_DIR/progress.json`` at every epoch's end (put it
    after the backup and the clocks; the chief's alone).

    Args:
      model_dir: The run's model directory.
      fields: Returns this process's :data:`EPOCH_FIELDS` lists so far.
      initial_epoch: Returns, given the model, the epoch this process resumed at (read when
        training begins, after the backup restored it).
      saved: What :func:`read` returned before training (``None``: nothing).
    """
    import keras

    class Progress(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._history: dict[str, list[float]] = {}
            self._start = 0

        def on_train_begin(self, logs=None):
            self._start = int(initial_epoch(self.model))

        def on_epoch_end(self, epoch, logs=None):
            for k, v in (logs or {}).items():
                self._history.setdefault(k, []).append(float(v))
            history, merged, gap = merge(saved, self._start, self._history, fields())
            if not gap:  # an incomplete history is not saved over a complete one
                write(model_dir, epoch + 1, history, merged)

    return Progress()
