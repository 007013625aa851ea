"""``BackupAndRestore`` that puts no optimizer state on the network, and ``save_model``.

Keras' callback makes every worker write the same files.  Here:

* the chief alone writes Keras' checkpoint (weights, the optimizer's shared state such as
  ``iterations`` and the inner optimizer's slots) to ``backup_dir``: reading mirrored
  variables is local;
* every worker writes its own replicas' per-replica state (residuals, local velocities,
  clipping state) to ``backup_dir/replica_state/worker_<i>.npz``
  (:mod:`tf_blocksparse.keras.replica_state`): local reads, no collective, so a backup costs
  no link bandwidth however large that state is; the values are copied at the backup and the
  file written in the background while training goes on (the next backup, and the end of
  training, wait for it, and raise if it failed);
* when training ends, the chief removes the backup once every worker's last state file is
  written (one scalar all-reduce; with ``delete_checkpoint``, Keras' default);
* on restore every worker loads the chief's checkpoint and each replica gets exactly its own
  state back; onto a different number of replicas each gets ``sum / N`` (one warning).  If
  the process died before every worker's state file of the last backup was written, every
  worker goes back to the backup before it (``double_checkpoint``, on by default).

``backup_dir`` must be shared by the workers (the same path on one host, or a shared file
system), as it must for Keras' own callback.  Training resumes at the start of the epoch after
the last backup (Keras' rule): with ``save_freq="epoch"`` and a data order that is a function
of the epoch, a resumed run ends with the same weights as an uninterrupted one; with a step
``save_freq`` the weights of the last backup are restored and that epoch is trained again.
"""

from __future__ import annotations

import json
import os

import keras
import tensorflow as tf

from tf_blocksparse import _compat
from tf_blocksparse.auto import link_probe
from tf_blocksparse.distribute.strategy import worker_role
from tf_blocksparse.keras import replica_state

#: The folder of ``backup_dir`` that holds the workers' per-replica state files.
STATE_DIR = "replica_state"


def block_sparse_optimizer(optimizer: keras.optimizers.Optimizer | None):
    """The ``BlockSparseOptimizer`` in ``optimizer`` (itself or inside a wrapper such as
    ``LossScaleOptimizer``), else ``None``."""
    from tf_blocksparse.keras.optimizer import BlockSparseOptimizer

    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, BlockSparseOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
        seen += 1
    return None


def resumed_epoch(backup_dir: str) -> int:
    """The epoch a ``BackupAndRestore(backup_dir)`` will make ``model.fit`` resume from (0 when
    there is no backup), read before training, e.g. to position a data pipeline."""
    path = os.path.join(backup_dir, _compat.BACKUP_FILES["_training_metadata_path"])
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return int(json.load(fh)["epoch"])


def initial_epoch(model: keras.Model) -> int:
    """The epoch the last ``model.fit`` started from: the one a ``BackupAndRestore`` callback
    resumed it at, 0 for a run that started afresh (read after ``fit``, e.g. for a run's
    record; :func:`resumed_epoch` reads it from the backup before training)."""
    return _compat.resumed_epoch(model)


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras ``BackupAndRestore`` for block-sparse training on several workers (Keras'
    arguments; ``double_checkpoint`` defaults to ``True``).

    Only the chief writes the model checkpoint; each worker saves its replicas' compressor
    state locally beside it (see the module docstring).

    Args:
      backup_dir: The backup folder, shared by the workers.
      save_freq: ``"epoch"`` or a number of steps between backups.
      double_checkpoint: Keep the backup before the last one, to fall back to when the last
        is torn.
      delete_checkpoint: Remove the folder when training ends.
      write_state: Writes this worker's state file in the background (the arguments of
        :func:`~tf_blocksparse.keras.replica_state.write_file`, the default), e.g. to copy
        it to durable storage after writing; what it raises is raised at the next backup or
        when training ends.
    """

    def __init__(self, backup_dir: str, save_freq: str | int = "epoch",
                 double_checkpoint: bool = True, delete_checkpoint: bool = True,
                 write_state: replica_state.WriteFile | None = None):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        if write_state is not None and not callable(write_state):
            raise TypeError(f"`write_state` must be callable, got {write_state!r}")
        self._write_state = write_state
        self._role = None
        self._writing = None  # the thread writing this worker's last state file

    @property
    def _state_dir(self) -> str:
        return os.path.join(self.backup_dir, STATE_DIR)

    def _strategy(self) -> tf.distribute.Strategy:
        return getattr(self.model, "distribute_strategy", None) or tf.distribute.get_strategy()

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._role = worker_role(self._strategy())
        opt = block_sparse_optimizer(self.model.optimizer)
        if opt is None:
            super().on_train_begin(logs)
            return
        has_checkpoint = os.path.exists(self._weights_path)
        with opt.replica_state_apart():
            super().on_train_begin(logs)
        if not has_checkpoint:
            return
        try:
            restored = replica_state.restore(opt, self._state_dir, self._role.index,
                                             self._role.num_workers)
        except replica_state.MissingState:
            if not (self.double_checkpoint and os.path.exists(self._prev_weights_path)):
                raise
            # a crash while the state files of the last backup were written: every worker
            # sees the same files and goes back to the backup before it
            with _compat.previous_backup(self), opt.replica_state_apart():
                super().on_train_begin(logs)
            restored = replica_state.restore(opt, self._state_dir, self._role.index,
                                             self._role.num_workers)
        if not restored:
            raise ValueError(f"{self.backup_dir}: a checkpoint without the per-replica state "
                             f"files of {STATE_DIR}/; the backup is incomplete")

    def _save_model(self) -> None:
        opt = block_sparse_optimizer(self.model.optimizer)
        role = self._role or worker_role(self._strategy())
        if self._writing is not None:  # one file in writing at a time
            self._writing.join()
        if role.is_chief:  # the model checkpoint is the chief's alone
            os.makedirs(self.backup_dir, exist_ok=True)
            if opt is None:
                super()._save_model()
            else:
                with opt.replica_state_apart():
                    super()._save_model()
        # the values now (training waits for this callback, so the chief's are those of its
        # checkpoint); the file in the background, after the chief's checkpoint so that the
        # two writes do not compete (see restore for a crash between them)
        if opt is not None:
            self._writing = replica_state.save(opt, self._state_dir, role.index,
                                               role.num_workers, background=True,
                                               write=self._write_state)

    def on_train_end(self, logs: dict | None = None) -> None:
        failed = None
        if self._writing is not None:
            writing, self._writing = self._writing, None
            try:
                writing.join()
            except OSError as e:  # raised below, once the other workers are not left waiting
                failed = e
        role = self._role or worker_role(self._strategy())
        if (self.delete_checkpoint and role.num_workers > 1
                and block_sparse_optimizer(self.model.optimizer) is not None):
            # every worker's last state file is written before the chief removes the
            # folder (else its removal races with another worker's rename into it)
            link_probe.barrier(self._strategy())
        if role.is_chief:  # the chief removes the shared directory
            super().on_train_end(logs)
        if failed is not None:
            raise failed


def save_model(model: keras.Model, path: str) -> None:
    """``model.save(path)`` on the chief; other workers write nothing.

    The ``.keras`` file holds the weights, the optimizer's configuration and its state with
    the per-replica state (residuals, local velocities) as the sum over replicas: loading it
    gives every replica ``sum / N``.  Saving needs no collective, so workers may call this
    (or ``model.save`` on the chief alone) at different points; with several workers the
    per-replica sum is estimated from the chief's replicas
    (:func:`~tf_blocksparse.keras.replica_state.cluster_value`; ``BackupAndRestore`` keeps
    every replica's exact state).

    Args:
      model: The trained model (optimizer included).
      path: A ``.keras`` file path.

    Raises:
      ValueError: ``path`` does not end in ``.keras``.
    """
    if not str(path).endswith(".keras"):
        raise ValueError(f"`path` must end in .keras, got {path!r}")
    if not worker_role(model.distribute_strategy).is_chief:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    model.save(path)
