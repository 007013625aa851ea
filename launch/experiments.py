"""Shared pieces of the evidence benchmarks: run one multi-worker training job, read its
metrics, derive time-to-accuracy, and plot.

A *run* is a real ``launch.cluster.local`` cluster of ``launch/train.py`` workers under
``MultiWorkerMirroredStrategy`` on real data (optionally on a shaped network: every worker in
its own network namespace, see ``launch/cluster/netem.py``); its chief's ``metrics.json`` gives the
per-epoch test accuracy (``history["val_accuracy"]``), the cumulative training seconds at the
end of each epoch (validation excluded, ``train_s_per_epoch``) and the bytes each worker hands
to the collectives per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, TextIO

from launch.config import TrainConfig
from launch.methods import (  # noqa: F401 (the table, kept importable from here)
    CONVERGENCE_METHODS,
    DEMO_METHODS,
    METHODS,
    TIME_TO_ACCURACY_METHODS,
    method_config,
    method_flags,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The worker command: ``launch.train`` as a module, started in :data:`ROOT`.
TRAIN = [sys.executable, "-m", "launch.train"]

def known_methods(names: Sequence[str], allowed: Sequence[str]) -> bool:
    """Whether ``names`` is a non-empty list of ``allowed`` names (a flag validator)."""
    return bool(names) and all(n in allowed for n in names)


def seed_list(values: Sequence[str]) -> bool:
    """Whether ``values`` is a non-empty list of distinct integers >= 0 (a flag validator)."""
    try:
        seeds = [int(v) for v in values]
    except ValueError:
        return False
    return bool(seeds) and min(seeds) >= 0 and len(set(seeds)) == len(seeds) and \
        all(str(s) == v.strip() for s, v in zip(seeds, values))


def spread(values: Sequence[float | None], digits: int = 4) -> dict | None:
    """Mean, sample std, min, max and count of the values that are not ``None`` (``None``
    when there are none); the std of a single value is 0."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"mean": round(statistics.fmean(xs), digits),
            "std": round(statistics.stdev(xs), digits) if len(xs) > 1 else 0.0,
            "min": round(min(xs), digits), "max": round(max(xs), digits), "n": len(xs)}


def train_config(method: str, density: float | None = None, **fields: Any) -> TrainConfig:
    """The ``launch.train`` config of one run of ``method`` (at ``density``, for the methods
    that take one): the flags' defaults with ``fields`` (:class:`~launch.config.TrainConfig`
    fields, e.g. ``model=``, ``epochs=``, ``seed=``) set.

    Raises:
      ValueError: An unknown method or field, or a value ``launch.train`` refuses.
    """
    return TrainConfig.default().replace(method=method_config(method, density), **fields)


#: Below this link rate the runs wait longer for a worker's heartbeat
#: (:data:`SLOW_LINK_HEARTBEAT_S`): the first weight broadcast of a large model (``vgg_fc``:
#: 69 MB, about a minute at 10 Mbit/s) holds heartbeats up past TensorFlow's 10 s.
SLOW_LINK_MBIT = 100.0
SLOW_LINK_HEARTBEAT_S = 600.0


def for_link(config: TrainConfig, bandwidth_mbit: float | None) -> TrainConfig:
    """``config`` as :func:`run_training` runs it on a link of ``bandwidth_mbit`` (``None``:
    loopback): below :data:`SLOW_LINK_MBIT` with ``--heartbeat_timeout_s`` of
    :data:`SLOW_LINK_HEARTBEAT_S` unless the config sets one."""
    if (bandwidth_mbit is not None and bandwidth_mbit < SLOW_LINK_MBIT
            and config.heartbeat_timeout_s is None):
        return config.replace(heartbeat_timeout_s=SLOW_LINK_HEARTBEAT_S)
    return config


def run_training(method: str, config: TrainConfig, num_workers: int,
                 bandwidth_mbit: float | None = None, latency_ms: float | None = None,
                 timeout_s: float = 0.0, log: bool = False,
                 stream: TextIO | None = None) -> dict:
    """Trains once on a local cluster and returns the chief's metrics record.

    Args:
        method: The run's name in the results (a key of :data:`METHODS`).
        config: The run (:func:`train_config`); it runs with ``--strategy=multiworker``,
            ``--deterministic`` and a temporary ``--model_dir``.
        num_workers: Worker processes.
        bandwidth_mbit: Shape every worker's link to this rate (needs root); ``None``: loopback.
            Below :data:`SLOW_LINK_MBIT` the run gets ``--heartbeat_timeout_s`` (unless the
            config sets one).
        latency_ms: Added one-way delay on the shaped links.
        timeout_s: Kill the cluster after this long (0: no limit).
        log: Stream the workers' output.
        stream: Where the workers' and the launcher's output goes (e.g. to read the
            launcher's traffic line); default: nowhere, or stdout with ``log``.

    Returns:
        The ``metrics.json`` record plus ``launcher_wall_s``.
    """
    from launch.cluster.local import run_local_cluster

    with tempfile.TemporaryDirectory(prefix="tfbs_run_") as tmp:
        run = for_link(config.replace(strategy="multiworker", model_dir=tmp,
                                      deterministic=True), bandwidth_mbit)
        cmd = [*TRAIN, *run.to_flags()]
        # the workers count their wall clock from here (launch/callbacks.launch_seconds)
        kwargs: dict = {"env": {"TFBS_LAUNCH_TIME": repr(time.time())}}
        if bandwidth_mbit is not None:
            kwargs.update(bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms or 0.0)
        t0 = time.perf_counter()
        out = None if log or stream is not None else open(os.devnull, "w")  # noqa: SIM115
        try:
            rc = run_local_cluster(cmd, num_workers=num_workers, timeout_s=timeout_s or None,
                                   log_dir=os.path.join(tmp, "logs"), cwd=ROOT,
                                   **({} if log else {"stream": stream or out}), **kwargs)
        finally:
            if out is not None:
                out.close()
        wall = time.perf_counter() - t0
        if rc != 0:
            logs = os.path.join(tmp, "logs", "worker_0.log")
            tail = open(logs).read()[-3000:] if os.path.exists(logs) else ""
            raise RuntimeError(f"{method}: cluster exited with {rc}\n{tail}")
        with open(os.path.join(tmp, "metrics.json")) as fh:
            record = json.load(fh)
    record["launcher_wall_s"] = round(wall, 2)
    record["method"] = method
    return record


def run_in_one_process(method: str, config: TrainConfig, num_devices: int,
                       timeout_s: float = 0.0, run_dir: str | None = None) -> dict:
    """Trains once in one process under ``MirroredStrategy`` on ``num_devices`` logical CPUs
    (the same wrapper and exchange per replica as a ``num_devices``-worker cluster, without
    the processes) and returns its metrics record, as :func:`run_training` does.

    Args:
      method: The method's name (recorded).
      config: The run (its strategy, devices and model directory are set here).
      num_devices: Logical CPUs, one replica each.
      timeout_s: Seconds before the run is killed (0: none).
      run_dir: Where the run trains and backs up after every epoch; the same call after a
        kill (another process, another session) resumes it from its last backup, and its
        record still holds every epoch (:mod:`launch.progress`).  Removed once the record is
        read.  A directory left by a run of other flags is started afresh.  ``None``: a
        temporary directory.

    Raises:
        RuntimeError: The training process failed (with the tail of its output), or a
          resumed run's record lacks its first epochs.
    """
    import subprocess

    scratch = (contextlib.nullcontext(run_dir) if run_dir is not None
               else tempfile.TemporaryDirectory(prefix="tfbs_run_"))
    with scratch as model_dir:
        run = config.replace(strategy="mirrored", num_devices=num_devices,
                             model_dir=model_dir, deterministic=True)
        flags = run.to_flags()
        cmd = [*TRAIN, *flags]
        if run_dir is not None:
            _claim_run_dir(run_dir, flags)
        t0 = time.perf_counter()
        env = {**os.environ, "TFBS_LAUNCH_TIME": repr(time.time())}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s or None, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{method}: exited with {proc.returncode}\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        with open(os.path.join(model_dir, "metrics.json")) as fh:
            record = json.load(fh)
    if record.get("history_from_epoch", 0):
        raise RuntimeError(f"{method}: resumed at epoch {record['initial_epoch']} without "
                           f"the figures of its first epochs ({model_dir}); remove the "
                           "directory to train it afresh")
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the parent of the partial runs, once empty
            os.rmdir(os.path.dirname(os.path.abspath(run_dir)))
    record["launcher_wall_s"] = round(wall, 2)  # this process's (since a resume)
    record["method"] = method
    return record


def _claim_run_dir(run_dir: str, flags: Sequence[str]) -> None:
    """Keeps ``run_dir`` for a resume if the run it holds had the ``launch.train`` flags
    ``flags``; otherwise empties it and records ``flags`` there."""
    path = os.path.join(run_dir, "command.json")
    if os.path.exists(run_dir):
        try:
            with open(path) as fh:
                same = json.load(fh) == list(flags)
        except (OSError, ValueError):
            same = False
        if same:
            print(f"{run_dir}: resuming", flush=True)
            return
        print(f"{run_dir}: another run's directory, started afresh", flush=True)
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    with open(path, "w") as fh:
        json.dump(list(flags), fh)


def slim(record: dict) -> dict:
    """The part of a run record kept in the results files (curves, bytes, method, flags)."""
    keep = ("method", "model", "bandwidth_mbit", "dataset", "test_accuracy", "test_correct",
            "test_examples", "steps",
            "steps_per_epoch", "epochs_trained", "payload_bytes_per_step",
            "dense_bytes_per_step", "train_s_per_epoch", "launcher_wall_s", "num_workers",
            "exchange_s_per_step", "compress_s_per_step", "auto_modes", "auto_decisions",
            "auto_measure_s", "seed")
    out = {k: record[k] for k in keep if k in record}
    out["history"] = {key: list(record["history"][key])
                      for key in ("val_accuracy", "payload_bytes") if key in record["history"]}
    return out


def time_to_target(record: dict, target: float) -> float | None:
    """Training seconds until the test accuracy first reaches ``target`` (``None``: never)."""
    for acc, t in zip(record["history"].get("val_accuracy", []), record["train_s_per_epoch"]):
        if acc >= target:
            return float(t)
    return None


def bytes_per_epoch(record: dict) -> list[float]:
    """Bytes each worker handed to the collectives in each epoch.

    From the per-epoch ``payload_bytes`` of the history (it changes under a density warm-up),
    else the record's steady ``payload_bytes_per_step``.
    """
    accs = record["history"].get("val_accuracy", [])
    per_step = record["history"].get("payload_bytes") or \
        [record["payload_bytes_per_step"]] * len(accs)
    return [float(b) * record["steps_per_epoch"] for b in per_step[:len(accs)]]


def curve(record: dict) -> tuple[list[float], list[float], list[float]]:
    """``(train seconds, cumulative MiB sent per worker, test accuracy)`` per epoch."""
    accs = record["history"].get("val_accuracy", [])
    sent, total = [], 0.0
    for b in bytes_per_epoch(record):
        total += b
        sent.append(total / 2**20)
    return list(record["train_s_per_epoch"][:len(accs)]), sent, list(accs)


def plot_curves(groups: dict[str, list[dict]], path: str, title: str) -> None:
    """One row per group (e.g. model @ bandwidth): accuracy vs time and vs bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.4 * len(groups)), squeeze=False)
    for row, (name, records) in enumerate(groups.items()):
        for rec in records:
            t, mib, acc = curve(rec)
            label = rec["method"] + (f" (seed {rec['seed']})" if rec.get("seed") else "")
            axes[row][0].plot(t, acc, marker="o", label=label)
            axes[row][1].plot(mib, acc, marker="o", label=label)
        axes[row][0].set_xlabel("training seconds")
        axes[row][1].set_xlabel("cumulative MiB sent per worker")
        axes[row][1].set_xscale("log")
        for ax in axes[row]:
            ax.set_ylabel("test accuracy")
            ax.set_title(name)
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
