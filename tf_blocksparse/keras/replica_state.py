"""Per-replica optimizer state (residuals, local velocities, clipping state; with local steps
also each replica's weights and inner optimizer state) saved and restored by each worker from
its own replicas, with no collective.

A cross-replica read of an on-read variable is an all-reduce of every replica's value; for
the compressor state that is a dense-sized collective over the (slow) link at every backup.
Instead every worker writes the values of its own replicas to
``<directory>/worker_<index>.npz`` and, on restore, each replica gets exactly its own values
back.  Restoring onto a different number of replicas gives every replica ``sum / N`` of the
saved state (``mean`` for mean-aggregated variables), with one warning.

File format (NumPy ``.npz``): ``meta`` (JSON: ``num_workers``, ``worker_index``,
``local_replicas``, ``iterations``, ``names``, ``aggregations``) and per state variable ``i``
and local replica ``j`` an array ``s{i}_r{j}`` of the variable's shape.  A file is written
next to its target and renamed over it, so a crash leaves the old file or the new one; the
previous file is kept as ``.bkp`` (restore picks the one whose ``iterations`` matches the
restored optimizer's).

What Keras saving (``model.save``, ``BackupAndRestore``) writes of the optimizer is decided
by :class:`~tf_blocksparse.keras.keras_saving.KerasSaving`: the per-replica state as its
sums, or nothing of it while a backup saves it per worker.
"""

from __future__ import annotations

import glob
import json
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tf_blocksparse import _compat

#: A function writing one worker's state file: ``(arrays, meta, directory, worker_index,
#: num_workers)``, as :func:`write_file`.
WriteFile = Callable[[dict, dict, str, int, int], None]

_BACKUP_SUFFIX = ".bkp"


def state_variables(optimizer: Any) -> list[Any]:
    """The optimizer's per-replica (on-read) variables, in ``optimizer.variables`` order,
    then the mirrored variables whose replicas' copies differ (``optimizer.local_variables``:
    local steps' weights and inner optimizer state) that are not among them."""
    local = list(getattr(optimizer, "local_variables", []) or [])
    ids = {id(v) for v in local}
    own = [v for v in optimizer.variables if _compat.is_on_read(v) or id(v) in ids]
    seen = {id(v) for v in own}
    return own + [v for v in local if id(v) not in seen]


def _aggregation(variable: Any) -> str:
    """How a replica's value relates to the saved total: ``"sum"`` (error feedback: the
    replicas' values add up) or ``"mean"`` (mean-aggregated state, and the copies of a
    mirrored variable that local steps let differ)."""
    if not _compat.is_on_read(variable):
        return "mean"
    agg = getattr(_compat.variable_storage(variable), "aggregation", None)
    return "mean" if "MEAN" in str(agg).upper() else "sum"


def cluster_value(variable: Any, num_replicas: int) -> np.ndarray:
    """What a cross-replica read of an on-read ``variable`` gives, from this worker's
    replicas alone (no collective): exact on one worker; with several, the sum over the
    cluster estimated as ``num_replicas`` times the local mean (a mean: the local mean)."""
    local = [np.asarray(c.numpy()) for c in _compat.local_components(variable)]
    if len(local) >= num_replicas:
        return np.asarray(variable.numpy())
    mean = np.mean(local, axis=0).astype(local[0].dtype)
    return mean if _aggregation(variable) == "mean" else mean * local[0].dtype.type(num_replicas)


def _worker_index(path: str) -> int | None:
    """The worker index in a state file's name (``worker_<i>.npz``, ``.bkp`` or not)."""
    index = os.path.basename(path)[len("worker_"):].split(".")[0]
    return int(index) if index.isdigit() else None


def worker_path(directory: str, worker_index: int) -> str:
    """The state file of worker ``worker_index`` in ``directory``."""
    return os.path.join(directory, f"worker_{worker_index}.npz")


class StateWriter(threading.Thread):
    """The thread writing one worker's state file in the background with ``write`` (the
    arguments of :func:`write_file`); :meth:`join` raises what the write raised (e.g. a full
    disk), so a failed backup is not silently lost."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict, directory: str,
                 worker_index: int, num_workers: int, write: WriteFile | None = None):
        super().__init__(daemon=True, name=f"replica-state-{worker_index}")
        self._args = (arrays, meta, directory, worker_index, num_workers)
        self._write = write or write_file
        self.path = worker_path(directory, worker_index)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._write(*self._args)
        except BaseException as e:  # noqa: BLE001 -- handed to the joining thread
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        """Waits for the write; raises ``OSError`` naming the file if it failed."""
        super().join(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise OSError(f"writing the per-replica state file {self.path} failed: "
                          f"{error!r}") from error


class MissingState(ValueError):
    """No complete set of per-replica state files was saved at the restored step."""


def save(optimizer: Any, directory: str, worker_index: int, num_workers: int,
         background: bool = False, write: WriteFile | None = None) -> StateWriter | None:
    """Writes this worker's replicas' state of ``optimizer`` (local reads only).

    The values are copied when called; with ``background`` the file is written by a thread
    (returned: join it before the next save), so training goes on meanwhile.

    Args:
      optimizer: A built optimizer whose per-replica state lives in on-read variables.
      directory: Where the workers' files go (shared by the workers).
      worker_index: This worker's index in the cluster.
      num_workers: Workers in the cluster.
      background: Write the file in a thread.
      write: Writes the file (default :func:`write_file`): a function of its arguments,
        e.g. one that calls :func:`write_file` and then copies the file elsewhere.

    Returns:
      The writing thread with ``background`` (its ``join`` raises what the write raised),
      else ``None`` (the file is written).
    """
    variables = state_variables(optimizer)
    arrays: dict[str, np.ndarray] = {}
    local = 0
    for i, v in enumerate(variables):
        parts = _compat.local_components(v)
        local = len(parts)
        for j, part in enumerate(parts):
            arrays[f"s{i}_r{j}"] = np.asarray(part.numpy())
    meta = {"num_workers": num_workers, "worker_index": worker_index,
            "local_replicas": local, "iterations": int(optimizer.iterations.numpy()),
            "names": [v.path for v in variables],
            "shapes": [list(v.shape) for v in variables],
            "aggregations": [_aggregation(v) for v in variables]}
    os.makedirs(directory, exist_ok=True)
    if not background:
        (write or write_file)(arrays, meta, directory, worker_index, num_workers)
        return None
    thread = StateWriter(arrays, meta, directory, worker_index, num_workers, write)
    thread.start()
    return thread


def write_file(arrays: dict[str, np.ndarray], meta: dict, directory: str, worker_index: int,
               num_workers: int) -> None:
    """Writes worker ``worker_index``'s state file in ``directory`` atomically (a temporary
    file renamed over it; the file it replaces is kept as its ``.bkp``).

    Args:
      arrays: The replicas' state values by key (``s<variable>_r<replica>``).
      meta: What :func:`restore` checks (cluster size, replicas, step, names, shapes).
      directory: The workers' shared state folder.
      worker_index: This worker's index.
      num_workers: Workers in the cluster (worker 0 removes files of larger clusters).
    """
    path = worker_path(directory, worker_index)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:  # a file object: no .npz appended to the name
        np.savez(fh, meta=np.asarray(json.dumps(meta)), **arrays)
    if os.path.exists(path):
        os.replace(path, path + _BACKUP_SUFFIX)
    os.replace(tmp, path)
    if worker_index == 0:  # files of workers a larger cluster had are not this run's
        for stale in glob.glob(os.path.join(directory, "worker_*.npz*")):
            index = _worker_index(stale)
            if index is not None and index >= num_workers:
                os.remove(stale)


def _read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        return meta, {k: np.asarray(data[k]) for k in data.files if k != "meta"}


def _candidates(directory: str, worker_index: int, iterations: int
                ) -> tuple[str | None, dict | None, dict | None]:
    """This worker's file (or its ``.bkp``) saved at ``iterations`` steps."""
    path = _saved_at(directory, worker_index, iterations)
    if path is None:
        return None, None, None
    meta, arrays = _read(path)
    return path, meta, arrays


def _saved_at(directory: str, worker_index: int, iterations: int) -> str | None:
    """The path of worker ``worker_index``'s file (or ``.bkp``) saved at ``iterations``."""
    path = worker_path(directory, worker_index)
    for candidate in (path, path + _BACKUP_SUFFIX):
        if os.path.exists(candidate):
            with np.load(candidate) as data:  # the meta entry only
                if json.loads(str(data["meta"]))["iterations"] == iterations:
                    return candidate
    return None


def restore(optimizer: Any, directory: str, worker_index: int, num_workers: int) -> bool:
    """Gives each of this worker's replicas its saved state back.

    Args:
      optimizer: The built optimizer, its shared state (``iterations``, weights) restored.
      directory: Where :func:`save` wrote the workers' files.
      worker_index: This worker's index in the cluster.
      num_workers: Workers in the cluster now.

    Returns:
      ``False`` when ``directory`` holds no state files (nothing restored), else ``True``.

    Raises:
      MissingState: No complete set of the workers' files saved at the restored step count
        (e.g. a crash while they were written).
      ValueError: The files do not match the optimizer (other variables or shapes).
    """
    if not glob.glob(os.path.join(directory, "worker_*.npz")):
        return False
    variables = state_variables(optimizer)
    iterations = int(optimizer.iterations.numpy())
    local = len(_compat.local_components(variables[0])) if variables else 0
    path, meta, arrays = _candidates(directory, worker_index, iterations)
    if meta is not None and any(_saved_at(directory, i, iterations) is None
                                for i in range(meta["num_workers"])):
        meta = None  # another worker's file of that step is missing: no exact restore
    if meta is not None and (meta["num_workers"], meta["local_replicas"]) == (num_workers, local):
        _check(meta, variables, path)
        for i, v in enumerate(variables):
            for j, part in enumerate(_compat.local_components(v)):
                part.assign(arrays[f"s{i}_r{j}"])
        return True
    return _redistribute(variables, directory, iterations, num_workers * local)


def _check(meta: dict, variables: Sequence[Any], path: str | None) -> None:
    """The saved state matches ``variables`` in number and shapes (names may differ: Keras
    numbers auto-named layers per process)."""
    shapes = [list(v.shape) for v in variables]
    if meta["shapes"] != shapes:
        raise ValueError(f"{path}: the saved per-replica state ({len(meta['shapes'])} "
                         f"variables, {meta['names']} of shapes {meta['shapes']}) does not "
                         f"match the optimizer's ({len(shapes)}, shapes {shapes})")


def _redistribute(variables: Sequence[Any], directory: str, iterations: int,
                  replicas: int) -> bool:
    """Every saved replica's state summed (or averaged), spread evenly over ``replicas``."""
    files = sorted(glob.glob(os.path.join(directory, "worker_*.npz")))
    saved = []
    for f in files:
        path, meta, arrays = _candidates(directory, _worker_index(f), iterations)
        if meta is not None:
            saved.append((path, meta, arrays))
    if not saved or len(saved) != saved[0][1]["num_workers"]:
        raise MissingState(f"{directory}: no complete set of per-replica state files saved at "
                         f"step {iterations} (found {[s[0] for s in saved]}); the backup is "
                         f"incomplete")
    for path, meta, _ in saved:
        _check(meta, variables, path)
    old = sum(meta["local_replicas"] for _, meta, _ in saved)
    warnings.warn(f"restoring per-replica optimizer state saved by {old} replicas onto "
                  f"{replicas}: every replica gets the saved sum / {replicas} (the total "
                  f"error feedback is kept, not each replica's own)", stacklevel=3)
    for i, v in enumerate(variables):
        total = sum(arrays[f"s{i}_r{j}"].astype(np.float64) for _, meta, arrays in saved
                    for j in range(meta["local_replicas"]))
        value = total / (old if saved[0][1]["aggregations"][i] == "mean" else replicas)
        for part in _compat.local_components(v):
            part.assign(value.astype(part.dtype.as_numpy_dtype))
    return True
