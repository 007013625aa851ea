"""Runs N copies of a command as a local multi-worker ``tf.distribute`` cluster.

Each worker gets its own ``TF_CONFIG`` (same loopback cluster, its own task index), its own
process group, and ``CUDA_VISIBLE_DEVICES=""`` unless ``keep_gpus``.  Every worker's output
is streamed line by line prefixed with ``[worker i] `` (and, with ``log_dir``, written to
``DIR/worker_i.log``).  If any worker fails, the others are torn down at once and the
failing worker's exit code is returned.

    from tf_blocksparse.launcher import run_local_cluster
    rc = run_local_cluster([sys.executable, "train.py"], num_workers=2, log_dir="logs")

``hosts`` and ``wrap`` let a caller run the workers elsewhere than on loopback (the
repository's ``launch.cluster.local`` puts each in its own ``tc``-shaped network namespace).
Standard library only: the command line ``tfbs-run`` (:mod:`tf_blocksparse.launcher.cli`)
starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from tf_blocksparse.launcher import processes

#: Exit code returned when ``timeout_s`` expires (as coreutils ``timeout``).
TIMEOUT_EXIT_CODE = 124
#: Exit code of the launcher after SIGINT / SIGTERM (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
#: Exit code returned when a worker command cannot be started at all.
START_FAILED_EXIT_CODE = 127

_TAIL_SHOW = 30  # lines of the failing worker's output shown in the failure message
_CMD_SHOW = 200  # characters of the command shown in the start-up line


def make_cluster(ports: Sequence[int], hosts: Sequence[str] | None = None
                 ) -> dict[str, list[str]]:
    """Builds the cluster spec for the given worker ports.

    Args:
        ports: One port per worker, in task-index order.
        hosts: One host per worker (e.g. namespace addresses); ``None``: ``localhost``.

    Returns:
        ``{"worker": ["localhost:P0", "localhost:P1", ...]}`` (or ``"H_i:P_i"``).

    Raises:
        ValueError: If ``hosts`` and ``ports`` differ in length.
    """
    if hosts is None:
        hosts = ["localhost"] * len(ports)
    if len(hosts) != len(ports):
        raise ValueError(f"hosts has {len(hosts)} entries, ports {len(ports)}")
    return {"worker": [f"{h}:{int(p)}" for h, p in zip(hosts, ports)]}


def make_tf_config(ports: Sequence[int], index: int, hosts: Sequence[str] | None = None) -> str:
    """Returns the ``TF_CONFIG`` JSON string of worker ``index``.

    Args:
        ports: One port per worker, in task-index order.
        index: This worker's task index, ``0 <= index < len(ports)``.
        hosts: One host per worker; ``None``: loopback (``localhost``).

    Returns:
        ``'{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": index}}'``.

    Raises:
        ValueError: If ``ports`` is empty, ``index`` is out of range or ``hosts`` has the
            wrong length.
    """
    if not ports:
        raise ValueError("ports must not be empty")
    if not 0 <= index < len(ports):
        raise ValueError(f"index must be in [0, {len(ports)}), got {index}")
    return json.dumps({"cluster": make_cluster(ports, hosts),
                       "task": {"type": "worker", "index": int(index)}})


def pick_ports(num_workers: int, base_port: int = 0) -> list[int]:
    """Chooses one port per worker.

    Args:
        num_workers: How many ports.
        base_port: 0 to let the system pick distinct unused ports (each bound once on every
            interface, all held until the last is picked), otherwise the first of
            ``num_workers`` consecutive ports.

    Returns:
        The ports, in task-index order.

    Raises:
        ValueError: If ``num_workers < 1`` or the port range leaves ``[1, 65535]``.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if base_port:
        if base_port < 1 or base_port + num_workers - 1 > 65535:
            raise ValueError(
                f"base_port={base_port} with num_workers={num_workers} leaves [1, 65535]")
        return list(range(base_port, base_port + num_workers))
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(num_workers):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("", 0))
            ports.append(sock.getsockname()[1])
    return ports


def worker_env(
    ports: Sequence[int],
    index: int,
    env: Mapping[str, str] | None = None,
    keep_gpus: bool = False,
    hosts: Sequence[str] | None = None,
) -> dict[str, str]:
    """Builds the environment of worker ``index``.

    Starts from the launcher's environment, hides the GPUs (``CUDA_VISIBLE_DEVICES=""``)
    unless ``keep_gpus``, sets ``PYTHONUNBUFFERED=1`` if unset (so Python workers stream
    their output live), applies ``env`` on top, and finally sets ``TF_CONFIG``,
    ``TF_BLOCKSPARSE_WORKER_INDEX`` and ``TF_BLOCKSPARSE_NUM_WORKERS``.

    Args:
        ports: One port per worker, in task-index order.
        index: The worker's task index.
        env: Extra variables; they override the launcher's environment and the GPU hiding.
        keep_gpus: Leave ``CUDA_VISIBLE_DEVICES`` as inherited.
        hosts: One host per worker for the cluster spec; ``None``: ``localhost``.

    Returns:
        The complete environment mapping for ``subprocess.Popen``.
    """
    out = dict(os.environ)
    if not keep_gpus:
        out["CUDA_VISIBLE_DEVICES"] = ""
    out.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        out.update({str(k): str(v) for k, v in env.items()})
    out["TF_CONFIG"] = make_tf_config(ports, index, hosts)
    out["TF_BLOCKSPARSE_WORKER_INDEX"] = str(index)
    out["TF_BLOCKSPARSE_NUM_WORKERS"] = str(len(ports))
    return out


def check_arguments(command: Sequence[str], num_workers: int, grace_s: float,
                    timeout_s: float | None) -> list[str]:
    """Checks :func:`run_local_cluster`'s arguments before anything starts.

    Returns:
        ``command`` as a list of strings.

    Raises:
        ValueError: As :func:`run_local_cluster` documents.
    """
    if isinstance(command, (str, bytes)):
        raise ValueError("command must be a sequence of arguments, not a single string")
    command = [os.fspath(c) for c in command]
    if not command:
        raise ValueError("command is required: the worker command line must not be empty")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 when given, got {timeout_s}")
    return command


def run_local_cluster(
    command: Sequence[str],
    num_workers: int,
    log_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 10.0,
    stream: TextIO | None = None,
    timeout_s: float | None = None,
    base_port: int = 0,
    keep_gpus: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    *,
    hosts: Sequence[str] | None = None,
    wrap: Callable[[list[str], int], list[str]] | None = None,
) -> int:
    """Runs ``num_workers`` copies of ``command`` as a local multi-worker cluster.

    Each worker runs in its own process group with its own ``TF_CONFIG`` (see
    :func:`worker_env`).  Output is streamed to ``stream`` prefixed with ``[worker i] ``.
    The first worker to exit non-zero makes the launcher terminate all others (SIGTERM to
    their process groups, SIGKILL after ``grace_s``) and print
    ``worker i failed with exit code X; last lines:`` followed by its last lines.  No worker
    process group outlives this call, whatever happens (including KeyboardInterrupt, which
    is re-raised after the teardown).

    Args:
        command: The worker command line (``argv``, no shell).
        num_workers: Number of workers, >= 1.
        log_dir: If given, each worker's output is also written to ``log_dir/worker_i.log``.
        env: Extra environment variables for the workers (override the inherited ones).
        grace_s: Seconds between SIGTERM and SIGKILL when tearing workers down.
        stream: Where output and launcher messages go; ``None`` means the current
            ``sys.stdout`` (looked up at call time).
        timeout_s: If set, tear everything down after this many seconds and return 124.
        base_port: 0 to pick free ports, else the first of ``num_workers`` consecutive ports.
        keep_gpus: Do not set ``CUDA_VISIBLE_DEVICES=""`` for the workers.
        cwd: The workers' working directory (``None``: the launcher's).
        hosts: One host per worker in the cluster spec (``None``: ``localhost``).
        wrap: ``wrap(command, i)`` is the command worker ``i`` runs (e.g. prefixed with
            ``ip netns exec``); ``None``: ``command`` itself.

    Returns:
        0 if every worker exited 0; the failing worker's exit code (128 + signal number if
        it was killed by a signal, 1 if out of range) otherwise; 124 on timeout; 127 if a
        worker could not be started.

    Raises:
        ValueError: If ``num_workers < 1``, ``command`` is empty or a string, ``grace_s < 0``
            or ``timeout_s <= 0``.
    """
    command = check_arguments(command, num_workers, grace_s, timeout_s)
    emit = processes.Emitter(sys.stdout if stream is None else stream)
    ports = pick_ports(num_workers, base_port)
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    shown = shlex.join(command).replace("\n", "\\n")
    if len(shown) > _CMD_SHOW:
        shown = shown[: _CMD_SHOW - 3] + "..."
    emit(f"[launcher] starting {num_workers} worker(s), cluster "
         f"{json.dumps(make_cluster(ports, hosts))}: {shown}")
    workers: list[processes.WorkerProcess] = []
    try:
        for i in range(num_workers):
            log_path = os.path.join(log_dir, f"worker_{i}.log") if log_dir is not None else None
            argv = command if wrap is None else wrap(command, i)
            try:
                workers.append(processes.WorkerProcess(
                    i, argv, worker_env(ports, i, env, keep_gpus, hosts), log_path, emit,
                    cwd=cwd))
            except OSError as e:
                emit(f"[launcher] failed to start worker {i}: {e}")
                return START_FAILED_EXIT_CODE
        return _watch(workers, emit, grace_s, timeout_s)
    finally:
        processes.terminate(workers, grace_s)
        for w in workers:
            w.join_reader(processes.READER_JOIN_S)


def _watch(workers: list[processes.WorkerProcess], emit: processes.Emitter, grace_s: float,
           timeout_s: float | None) -> int:
    """Waits for the workers: all done, the first failure (the others torn down) or the
    timeout; returns :func:`run_local_cluster`'s exit code."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed: processes.WorkerProcess | None = None
    while True:
        pending = False
        for w in workers:
            rc = w.poll()
            if rc is None:
                pending = True
            elif rc != 0 and failed is None:
                failed = w
        if failed is not None or not pending:
            break
        if deadline is not None and time.monotonic() >= deadline:
            emit(f"[launcher] timed out after {timeout_s:g} s; terminating all workers")
            return TIMEOUT_EXIT_CODE
        time.sleep(processes.POLL_S)

    if failed is None:
        return 0
    rc = failed.reaped_rc
    assert rc is not None
    if any(w.poll() is None for w in workers):
        emit(f"[launcher] worker {failed.index} failed; terminating the other workers")
    processes.terminate(workers, grace_s)
    failed.join_reader(processes.READER_JOIN_S)
    emit(f"[launcher] worker {failed.index} failed with {processes.describe_exit(rc)}; "
         "last lines:")
    for line in list(failed.tail)[-_TAIL_SHOW:]:
        emit(f"    {line}")
    return processes.launcher_exit_code(rc)
