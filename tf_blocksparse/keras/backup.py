"""``BackupAndRestore`` that is safe with several worker processes.

Keras' callback makes every worker write the same files.  Saving must still run on every
worker (reading per-replica residuals is a collective), so here the chief writes to
``backup_dir`` and other workers to a private ``<backup_dir>.worker_<i>`` that is removed
again; every worker restores from the chief's files.  Restored residuals: a checkpoint
holds their sum over replicas, and on load each replica gets ``sum / N``, so the total error
feedback carried into the resumed run is the one that was saved.
"""

from __future__ import annotations

import os
import shutil

import keras
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.distribute.strategy import worker_role


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras ``BackupAndRestore`` with per-worker write directories (same arguments)."""

    def __init__(self, backup_dir: str, save_freq: str | int = "epoch",
                 double_checkpoint: bool = True, delete_checkpoint: bool = True):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self._chief_dir = backup_dir
        self._is_chief = True

    def _use_dir(self, directory: str) -> None:
        _compat.set_backup_directory(self, directory)

    def on_train_begin(self, logs: dict | None = None) -> None:
        role = worker_role(
            getattr(self.model, "distribute_strategy", None) or tf.distribute.get_strategy())
        self._is_chief = role.is_chief
        self._use_dir(self._chief_dir)  # everybody restores from the chief's files
        super().on_train_begin(logs)
        if not self._is_chief:
            self._use_dir(f"{self._chief_dir.rstrip('/')}.worker_{role.index}")

    def _save_model(self) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)  # workers may race to create parents
        super()._save_model()

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self._is_chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
            return
        super().on_train_end(logs)


def save_model(model: keras.Model, path: str) -> None:
    """``model.save(path)`` from every worker; only the chief's file stays at ``path``.

    Under a multi-worker strategy saving reads the per-replica optimizer state (residuals),
    which is a collective, so every worker must save at the same point; non-chief workers
    write to a private temporary file that is removed again.

    Args:
      model: The trained model (optimizer included).
      path: A ``.keras`` file path.

    Raises:
      ValueError: ``path`` does not end in ``.keras``.
    """
    if not str(path).endswith(".keras"):
        raise ValueError(f"`path` must end in .keras, got {path!r}")
    role = worker_role(model.distribute_strategy)
    target = path if role.is_chief else f"{path}.worker_{role.index}.keras"
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    model.save(target)
    if not role.is_chief:
        os.remove(target)
