"""Runs N copies of a command as a local multi-worker ``tf.distribute`` cluster.

Each worker gets its own ``TF_CONFIG`` (same loopback cluster, its own task index), its own
process group, and ``CUDA_VISIBLE_DEVICES=""`` unless ``keep_gpus``.  Every worker's output
is streamed line by line prefixed with ``[worker i] `` (and, with ``log_dir``, written to
``DIR/worker_i.log``).  If any worker fails, the others are torn down at once and the
failing worker's exit code is returned.

With ``bandwidth_mbit`` and/or ``latency_ms`` (Linux, root only) every worker runs in its own
network namespace on a ``tc``-shaped bridge (:mod:`launch.cluster.netem`): the cluster spec
holds the workers' namespace addresses, each command is wrapped in ``ip netns exec``, and
the namespaces and links are removed when the run ends, whatever the reason.

    from launch.cluster.local import run_local_cluster
    rc = run_local_cluster([sys.executable, "-m", "launch.train", "--strategy=multiworker"],
                           num_workers=2, log_dir="runs/logs", cwd=REPOSITORY_ROOT)

The command line is ``python -m launch.local_cluster`` (:mod:`launch.local_cluster`).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

import portpicker

from launch.cluster import processes
from launch.cluster.netem import NetemError, NetworkCluster

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
    """Chooses one loopback port per worker.

    Args:
        num_workers: How many ports.
        base_port: 0 to let ``portpicker`` pick distinct unused ports, otherwise the first of
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
    ports: list[int] = []
    while len(ports) < num_workers:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
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
    bandwidth_mbit: float | None = None,
    latency_ms: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
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
        base_port: 0 to pick free ports with ``portpicker``, else the first of
            ``num_workers`` consecutive ports.
        keep_gpus: Do not set ``CUDA_VISIBLE_DEVICES=""`` for the workers.
        bandwidth_mbit: If set (> 0), run every worker in its own network namespace with a
            link of this rate per direction (see :class:`launch.cluster.netem.NetworkCluster`); the
            cluster spec then holds the namespace addresses instead of ``localhost``.
        latency_ms: If set (> 0), the same namespaces with this one-way delay per packet
            (needs the kernel's netem).  Namespaces and links are removed before returning
            (also on failure, timeout or KeyboardInterrupt).
        cwd: The workers' working directory (``None``: the launcher's); the repository
            root for ``python -m launch.train`` workers.

    Returns:
        0 if every worker exited 0; the failing worker's exit code (128 + signal number if
        it was killed by a signal, 1 if out of range) otherwise; 124 on timeout; 127 if a
        worker could not be started.

    Raises:
        ValueError: If ``num_workers < 1``, ``command`` is empty, ``grace_s < 0``,
            ``timeout_s <= 0``, ``bandwidth_mbit <= 0`` or ``latency_ms < 0``.
        launch.cluster.netem.NetemUnavailableError: A shaped network was asked for without root,
            without ``ip`` / ``tc``, or (latency) without netem; nothing was started.
        launch.cluster.netem.NetemError: The network set-up or tear-down failed.
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
    net = None
    if bandwidth_mbit is not None or latency_ms:
        net = NetworkCluster(num_workers, bandwidth_mbit=bandwidth_mbit,
                             latency_ms=latency_ms or 0.0)  # validates both

    emit = processes.Emitter(sys.stdout if stream is None else stream)
    ports = pick_ports(num_workers, base_port)
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    shown = shlex.join(command).replace("\n", "\\n")
    if len(shown) > _CMD_SHOW:
        shown = shown[: _CMD_SHOW - 3] + "..."

    with net if net is not None else contextlib.nullcontext():
        hosts = None
        if net is not None:
            hosts = [net.worker_address(i) for i in range(num_workers)]
            bw = "unshaped" if net.bandwidth_mbit is None else f"{net.bandwidth_mbit:g} Mbit/s"
            emit(f"[launcher] network: namespaces {net.namespace(0)}..{num_workers - 1} on "
                 f"bridge namespace {net.bridge_namespace}, subnet {net.subnet}, {bw} per "
                 f"link and direction, one-way latency {net.latency_ms:g} ms")
        emit(f"[launcher] starting {num_workers} worker(s), cluster "
             f"{json.dumps(make_cluster(ports, hosts))}: {shown}")
        try:
            return _run_workers(command, num_workers, ports, hosts, net, log_dir, env,
                                grace_s, emit, timeout_s, keep_gpus, cwd)
        finally:
            if net is not None:
                with contextlib.suppress(NetemError, OSError, ValueError, KeyError):
                    emit("[launcher] network traffic (eth0 bytes per worker): "
                         + json.dumps(net.traffic()))


def _run_workers(
    command: list[str],
    num_workers: int,
    ports: list[int],
    hosts: list[str] | None,
    net: NetworkCluster | None,
    log_dir: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    grace_s: float,
    emit: processes.Emitter,
    timeout_s: float | None,
    keep_gpus: bool,
    cwd: str | os.PathLike[str] | None = None,
) -> int:
    """Starts, watches and tears down the workers (the body of :func:`run_local_cluster`)."""
    workers: list[processes.WorkerProcess] = []
    try:
        for i in range(num_workers):
            log_path = os.path.join(log_dir, f"worker_{i}.log") if log_dir is not None else None
            argv = command if net is None else net.wrap(command, i)
            try:
                workers.append(processes.WorkerProcess(
                    i, argv, worker_env(ports, i, env, keep_gpus, hosts), log_path, emit,
                    cwd=cwd))
            except OSError as e:
                emit(f"[launcher] failed to start worker {i}: {e}")
                return START_FAILED_EXIT_CODE

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
    finally:
        processes.terminate(workers, grace_s)
        for w in workers:
            w.join_reader(processes.READER_JOIN_S)
