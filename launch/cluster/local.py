"""Runs N copies of a command as a local multi-worker ``tf.distribute`` cluster, on loopback
or on a shaped network.

The launcher itself is the package's :mod:`tf_blocksparse.launcher` (``tfbs-run``): every
worker gets its own ``TF_CONFIG``, its own process group and ``CUDA_VISIBLE_DEVICES=""``
unless ``keep_gpus``; output is streamed prefixed ``[worker i] `` (and, with ``log_dir``,
written to ``DIR/worker_i.log``); a failing worker tears the others down.  This module adds
what the repository's benchmarks need: with ``bandwidth_mbit`` and/or ``latency_ms`` (Linux,
root only) every worker runs in its own network namespace on a ``tc``-shaped bridge
(:mod:`launch.cluster.netem`): the cluster spec holds the workers' namespace addresses, each
command is wrapped in ``ip netns exec``, and the namespaces and links are removed when the run
ends, whatever the reason.

    from launch.cluster.local import run_local_cluster
    rc = run_local_cluster([sys.executable, "-m", "launch.train", "--strategy=multiworker"],
                           num_workers=2, log_dir="runs/logs", cwd=REPOSITORY_ROOT)

The command line is ``python -m launch.local_cluster`` (:mod:`launch.local_cluster`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from launch.cluster.netem import NetemError, NetworkCluster
from tf_blocksparse.launcher import cluster as core
from tf_blocksparse.launcher import processes
from tf_blocksparse.launcher.cluster import (
    INTERRUPTED_EXIT_CODE,
    START_FAILED_EXIT_CODE,
    TIMEOUT_EXIT_CODE,
    make_cluster,
    make_tf_config,
    pick_ports,
    worker_env,
)

__all__ = ["INTERRUPTED_EXIT_CODE", "START_FAILED_EXIT_CODE", "TIMEOUT_EXIT_CODE",
           "make_cluster", "make_tf_config", "pick_ports", "run_local_cluster", "worker_env"]


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

    As :func:`tf_blocksparse.launcher.run_local_cluster` (the arguments it shares mean the
    same), optionally on a shaped network.

    Args:
        command: The worker command line (``argv``, no shell).
        num_workers: Number of workers, >= 1.
        log_dir: If given, each worker's output is also written to ``log_dir/worker_i.log``.
        env: Extra environment variables for the workers (override the inherited ones).
        grace_s: Seconds between SIGTERM and SIGKILL when tearing workers down.
        stream: Where output and launcher messages go; ``None``: the current ``sys.stdout``.
        timeout_s: If set, tear everything down after this many seconds and return 124.
        base_port: 0 to pick free ports, else the first of ``num_workers`` consecutive ports.
        keep_gpus: Do not set ``CUDA_VISIBLE_DEVICES=""`` for the workers.
        bandwidth_mbit: If set (> 0), run every worker in its own network namespace with a
            link of this rate per direction (see :class:`launch.cluster.netem.NetworkCluster`);
            the cluster spec then holds the namespace addresses instead of ``localhost``.
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
        launch.cluster.netem.NetemUnavailableError: A shaped network was asked for without
            root, without ``ip`` / ``tc``, or (latency) without netem; nothing was started.
        launch.cluster.netem.NetemError: The network set-up or tear-down failed.
    """
    command = core.check_arguments(command, num_workers, grace_s, timeout_s)
    run = {"log_dir": log_dir, "env": env, "grace_s": grace_s, "stream": stream,
           "timeout_s": timeout_s, "base_port": base_port, "keep_gpus": keep_gpus, "cwd": cwd}
    if bandwidth_mbit is None and not latency_ms:
        return core.run_local_cluster(command, num_workers, **run)
    net = NetworkCluster(num_workers, bandwidth_mbit=bandwidth_mbit,
                         latency_ms=latency_ms or 0.0)  # validates both
    emit = processes.Emitter(sys.stdout if stream is None else stream)
    with net:
        bw = "unshaped" if net.bandwidth_mbit is None else f"{net.bandwidth_mbit:g} Mbit/s"
        emit(f"[launcher] network: namespaces {net.namespace(0)}..{num_workers - 1} on "
             f"bridge namespace {net.bridge_namespace}, subnet {net.subnet}, {bw} per "
             f"link and direction, one-way latency {net.latency_ms:g} ms")
        try:
            return core.run_local_cluster(
                command, num_workers, **run,
                hosts=[net.worker_address(i) for i in range(num_workers)], wrap=net.wrap)
        finally:
            with contextlib.suppress(NetemError, OSError, ValueError, KeyError):
                emit("[launcher] network traffic (eth0 bytes per worker): "
                     + json.dumps(net.traffic()))
