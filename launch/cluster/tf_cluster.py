"""An emulated multi-host TensorFlow cluster on one machine: worker servers plus one client.

:class:`ServerCluster` starts ``num_workers`` processes that each run a
``tf.distribute.Server`` (:mod:`tf_blocksparse.runtime.remote`), waits until they listen,
and then runs a *client* command that connects to them and drives one ``tf.function`` across
all of them (the pipeline and hybrid trainers).  Optionally (Linux, root):

- every process gets its own network namespace (:class:`launch.cluster.netem.NetworkCluster`)
  and the link from worker ``i`` to worker ``j`` is shaped to ``pair_mbit[i][j]`` (e.g. from a
  :class:`~tf_blocksparse.planning.Topology`:
  :func:`~launch.cluster.shaping.topology_rates`); the client's own links are not shaped (it
  only feeds the input batches);
- worker ``i``'s memory is capped at ``memory_mib[i]`` MiB
  (:class:`launch.cluster.cgroups.ResourceCap`); a worker that needs more is killed by the
  kernel's out-of-memory killer, and the launcher says so;
- every worker (and the client) gets a CPU quota of ``worker_cpus`` CPUs, so that processes
  sharing this machine's cores compute like separate hosts of a fixed speed (a plan's
  predicted compute times then hold while every stage is busy).

Failure handling: a worker that exits while the client runs stops the client (SIGTERM, then
SIGKILL after ``grace_s``) and raises :class:`WorkerFailure` naming the worker, its address,
its exit status and whether the OOM killer took it (within a second of the exit: the launcher
polls).  Processes, namespaces and cgroups are removed on every exit path (``close`` runs on
``__exit__``, at interpreter exit and on SIGTERM / SIGHUP).

    with ServerCluster(4, pair_mbit=topology_rates(topo, 200), memory_mib=[None, 900]) as c:
        rc = c.run_client([sys.executable, "-m", "launch.train_pipeline", ...])
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from launch.cluster import local
from launch.cluster.cgroups import ResourceCap, require_controller
from launch.cluster.netem import NetworkCluster, require_privileges
from tf_blocksparse.launcher import processes
from tf_blocksparse.runtime.remote import CLUSTER_ENV, READY, TASK_ENV

#: Port every process listens on inside its own namespace (the addresses differ).
NAMESPACE_PORT = 2222
_POLL_S = 0.2


class WorkerFailure(RuntimeError):
    """A worker process failed to start or died while the client ran.

    Attributes:
        index: The worker's task index.
        oom_killed: Whether the kernel's out-of-memory killer killed it.
    """

    def __init__(self, message: str, index: int, oom_killed: bool) -> None:
        super().__init__(message)
        self.index = index
        self.oom_killed = oom_killed


def _per_worker(arg: str, values: object, num_workers: int, kind: type) -> tuple:
    """One value (or ``None``) per worker from ``None``, a scalar or a sequence."""
    if values is None or isinstance(values, (int, float)) and not isinstance(values, bool):
        out = (values,) * num_workers
    else:
        out = tuple(values)  # type: ignore[arg-type]
    if len(out) != num_workers:
        raise ValueError(f"{arg} must hold one entry per worker: {num_workers}, got {len(out)}")
    for i, c in enumerate(out):
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or (kind is int and int(c) != c) or c <= 0):
            raise ValueError(f"{arg}[{i}] must be a {kind.__name__} > 0 or None, got {c!r}")
    return tuple(None if c is None else kind(c) for c in out)


class ServerCluster:
    """Worker servers (and the client run in :meth:`run_client`) on one machine.

    Args:
        num_workers: Worker processes, >= 1.
        pair_mbit: Per-pair link rates among the workers (Mbit/s, see
            :class:`launch.cluster.netem.NetworkCluster`); ``None``: unshaped.
        latency_ms: One-way delay on the workers' shaped links.
        memory_mib: Per worker, a memory cap in MiB or ``None`` (one value: every worker).
        worker_cpus: Per worker, a CPU quota in CPUs or ``None`` (one value: every worker).
        client_cpus: The client's CPU quota (e.g. the workers', so that it profiles layers
            at their speed), or ``None``.
        namespaces: Run every process in its own network namespace; default: when
            ``pair_mbit`` or ``latency_ms`` is given.  Without namespaces everything runs on
            loopback (no root needed unless ``memory_mib`` caps something).
        log_dir: Also write each process's output to ``DIR/worker_<i>.log`` /
            ``DIR/client.log``.
        stream: Where the processes' prefixed output goes (default ``sys.stdout``).
        ready_timeout_s: How long a worker may take to start listening.
        grace_s: SIGTERM-to-SIGKILL grace when stopping processes.

    Raises:
        ValueError: Bad arguments.
    """

    def __init__(self, num_workers: int, *, pair_mbit: Sequence[Sequence[float]] | None = None,
                 latency_ms: float = 0.0, memory_mib: Sequence[int | None] | int | None = None,
                 worker_cpus: Sequence[float | None] | float | None = None,
                 client_cpus: float | None = None, namespaces: bool | None = None,
                 log_dir: str | None = None, stream: TextIO | None = None,
                 ready_timeout_s: float = 180.0, grace_s: float = 5.0) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self.memory_mib = _per_worker("memory_mib", memory_mib, num_workers, int)
        self.worker_cpus = _per_worker("worker_cpus", worker_cpus, num_workers, float)
        self.client_cpus = _per_worker("client_cpus", client_cpus, 1, float)[0]
        if namespaces is None:
            namespaces = pair_mbit is not None or bool(latency_ms)
        elif not namespaces and (pair_mbit is not None or latency_ms):
            raise ValueError("pair_mbit / latency_ms shape namespace links: they need "
                             "namespaces=True")
        self._net = (NetworkCluster(num_workers + 1, latency_ms=latency_ms, pair_mbit=pair_mbit)
                     if namespaces else None)  # the last namespace is the client's
        self.log_dir = log_dir
        self._emit = processes.Emitter(stream or sys.stdout)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.cluster: dict[str, list[str]] = {}
        self.workers: list[processes.WorkerProcess] = []
        self.caps: list[ResourceCap | None] = []
        self._client_cap: ResourceCap | None = None
        self.idle_rss_bytes: list[int] = []
        self._client: processes.WorkerProcess | None = None

    # ------------------------------------------------------------------ set-up, tear-down
    def __enter__(self) -> ServerCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _address(self, index: int, ports: Sequence[int]) -> str:
        if self._net is None:
            return f"localhost:{ports[index]}"
        return f"{self._net.worker_address(index)}:{NAMESPACE_PORT}"

    def start(self) -> None:
        """Sets up namespaces and cgroups, starts the workers and waits until they listen.

        Raises:
            launch.cluster.netem.NetemUnavailableError: Root or kernel features missing.
            launch.cluster.cgroups.CgroupUnavailableError: Root or a controller missing.
            WorkerFailure: A worker exited or did not listen within ``ready_timeout_s``.
        """
        if self._net is not None:
            require_privileges()
        if any(c is not None for c in self.memory_mib):
            require_controller("memory")
        if self.client_cpus or any(c is not None for c in self.worker_cpus):
            require_controller("cpu")
        if self._net is not None:
            self._net.setup()
            ports: list[int] = []
        else:
            ports = local.pick_ports(self.num_workers + 1)
        n = self.num_workers
        self.cluster = {"worker": [self._address(i, ports) for i in range(n)],
                        "chief": [self._address(n, ports)]}
        for i, (mib, cpus) in enumerate(zip(self.memory_mib, self.worker_cpus)):
            cap = ResourceCap(mib * 2**20 if mib else None, cpus) if mib or cpus else None
            self.caps.append(cap)
            if cap is not None:
                cap.setup()
            cmd = [sys.executable, "-m", "tf_blocksparse.runtime.remote"]
            # the namespace first: `ip netns exec` remounts /sys, hiding the cgroup files
            if self._net is not None:
                cmd = self._net.wrap(cmd, i)
            if cap is not None:
                cmd = cap.wrap(cmd)
            self.workers.append(processes.WorkerProcess(
                i, cmd, self._env({TASK_ENV: str(i)}), self._log(f"worker_{i}"), self._emit,
                watch=READY))
        deadline = time.monotonic() + self.ready_timeout_s
        for w in self.workers:
            while not w.seen.wait(_POLL_S):
                if w.poll() is not None:
                    raise self._failure(w, "exited before its server listened")
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"worker {w.index} ({self.cluster['worker'][w.index]}) "
                                        f"did not listen within {self.ready_timeout_s:g} s",
                                        w.index, False)
        self.idle_rss_bytes = [_rss_bytes(w.proc.pid) for w in self.workers]

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update({CLUSTER_ENV: json.dumps(self.cluster), "CUDA_VISIBLE_DEVICES": "",
                    "PYTHONUNBUFFERED": "1"})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.update(extra)
        return env

    def _log(self, name: str) -> str | None:
        if not self.log_dir:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, f"{name}.log")

    def close(self) -> None:
        """Stops every process and removes cgroups and namespaces (idempotent)."""
        procs = [w for w in [*self.workers, self._client] if w is not None]
        with contextlib.suppress(Exception):
            processes.terminate(procs, self.grace_s)
        for w in procs:
            w.join_reader(2.0)
        errors = []
        for cap in [*self.caps, self._client_cap]:
            if cap is not None:
                try:
                    cap.close()
                except OSError as e:
                    errors.append(str(e))
        if self._net is not None:
            try:
                self._net.close()
            except Exception as e:  # noqa: BLE001 - report after the rest is cleaned
                errors.append(str(e))
        self.workers, self.caps, self._client, self._client_cap = [], [], None, None
        if errors:
            raise RuntimeError("tear-down incomplete: " + "; ".join(errors))

    # ------------------------------------------------------------------ running
    def run_client(self, command: Sequence[str], env: Mapping[str, str] | None = None,
                   timeout_s: float | None = None) -> int:
        """Runs the client command (in the client's namespace) until it ends.

        The client finds the cluster in ``$TFBS_CLUSTER`` (see
        :func:`tf_blocksparse.runtime.remote.cluster_from_env`); its output is streamed
        with the prefix ``[client]``.

        Returns:
            The client's exit code.

        Raises:
            WorkerFailure: A worker died while the client ran (the client is stopped first).
            TimeoutError: The client ran longer than ``timeout_s``.
        """
        if not self.workers:
            raise RuntimeError("start the cluster first (use it as a context manager)")
        cmd = list(command)
        if self.client_cpus and self._client_cap is None:
            self._client_cap = ResourceCap(cpus=self.client_cpus)
            self._client_cap.setup()
        if self._net is not None:
            cmd = self._net.wrap(cmd, self.num_workers)
        if self._client_cap is not None:
            cmd = self._client_cap.wrap(cmd)
        client = processes.WorkerProcess(self.num_workers, cmd, self._env(dict(env or {})),
                                       self._log("client"), self._emit, label="client")
        self._client = client
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        while True:
            rc = client.poll()
            dead = next((w for w in self.workers if w.poll() is not None), None)
            if dead is not None:
                processes.terminate([client], self.grace_s)
                client.join_reader(2.0)
                raise self._failure(dead, "died while the client ran")
            if rc is not None:
                client.join_reader(5.0)
                return rc
            if deadline is not None and time.monotonic() > deadline:
                processes.terminate([client], self.grace_s)
                raise TimeoutError(f"client ran longer than timeout_s={timeout_s:g}")
            time.sleep(_POLL_S)

    def _failure(self, w: processes.WorkerProcess, what: str) -> WorkerFailure:
        cap = self.caps[w.index] if w.index < len(self.caps) else None
        oom = bool(cap is not None and cap.oom_kills())
        why = processes.describe_exit(w.poll() if w.poll() is not None else 0)
        if oom:
            why += (f"; killed by the out-of-memory killer: it needed more than its memory "
                    f"cap of {self.memory_mib[w.index]} MiB")
        tail = "\n".join(list(w.tail)[-10:])
        return WorkerFailure(f"worker {w.index} ({self.cluster['worker'][w.index]}) {what}: "
                             f"{why}" + (f"\nlast output:\n{tail}" if tail else ""),
                             w.index, oom)


def _rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its children (the worker behind ``ip netns exec``/sh)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo += [int(c) for c in fh.read().split()]
    return total


def worker_signal(cluster: ServerCluster, index: int, sig: int = signal.SIGKILL) -> None:
    """Sends ``sig`` to worker ``index``'s process group (to test failure handling)."""
    cluster.workers[index].signal_group(sig)
