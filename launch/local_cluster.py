"""Run N copies of a command as a local multi-worker ``tf.distribute`` cluster.

Each worker gets its own ``TF_CONFIG`` (same loopback cluster, its own task index), its own
process group, and ``CUDA_VISIBLE_DEVICES=""`` unless ``--keep_gpus``.  Every worker's output
is streamed line by line to the launcher's stdout prefixed with ``[worker i] `` (and, with
``--log_dir``, written to ``DIR/worker_i.log``).  If any worker fails, the others are torn
down at once and the launcher exits with the failing worker's code; Ctrl-C (or SIGTERM)
tears everything down and exits 130.

With ``--bandwidth_mbit`` and/or ``--latency_ms`` (Linux, root only) every worker runs in its
own network namespace on a ``tc``-shaped bridge (:mod:`launch.netem`): the cluster spec holds
the workers' namespace addresses, each command is wrapped in ``ip netns exec``, and the
namespaces and links are removed when the launcher ends, whatever the reason.  Without root
the launcher says so and exits 1 before starting anything.

    python launch/local_cluster.py --num_workers=2 [--base_port=0] [--log_dir=DIR]
        [--grace_s=10] [--timeout_s=0] [--keep_gpus] [--bandwidth_mbit=100]
        [--latency_ms=0] -- python my_train.py --flag=...

(one command line; ``--num_workers`` defaults to 2, ``--timeout_s=0`` means no timeout).

Everything after ``--`` is the worker command, passed through untouched.  As a library::

    from launch.local_cluster import run_local_cluster
    rc = run_local_cluster(["python", "train.py"], num_workers=2, log_dir="runs/logs")
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

import portpicker
from absl import app, flags

from launch.netem import NetemError, NetworkCluster

#: Exit code returned when ``timeout_s`` expires (as coreutils ``timeout``).
TIMEOUT_EXIT_CODE = 124
#: Exit code of the launcher after SIGINT / SIGTERM (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
#: Exit code returned when a worker command cannot be started at all.
START_FAILED_EXIT_CODE = 127

_TAIL_KEEP = 50  # lines of each worker's output kept in memory
_TAIL_SHOW = 30  # lines of the failing worker's output shown in the failure message
_CMD_SHOW = 200  # characters of the command shown in the start-up line
_POLL_S = 0.05
_READER_JOIN_S = 5.0


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


def _describe_exit(returncode: int) -> str:
    """Human-readable exit status (``exit code 3`` or ``exit code -9 (SIGKILL)``)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exit code {returncode} ({name})"
    return f"exit code {returncode}"


def _launcher_exit_code(returncode: int) -> int:
    """Maps a failing worker's return code to the launcher's (non-zero) exit code."""
    if returncode < 0:
        return 128 + (-returncode)
    if 0 < returncode < 256:
        return returncode
    return 1


class _Worker:
    """One worker subprocess plus the thread that streams its output."""

    def __init__(
        self,
        index: int,
        command: Sequence[str],
        env: Mapping[str, str],
        log_path: str | None,
        emit: _Emitter,
        label: str | None = None,
        watch: str | None = None,
    ) -> None:
        self.index = index
        self.label = label or f"worker {index}"
        self.watch = watch
        self.seen = threading.Event()  # set once a line starting with ``watch`` arrives
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_KEEP)
        self._emit = emit
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None
        try:
            self.proc = subprocess.Popen(
                list(command),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                encoding="utf-8",
                errors="replace",
                bufsize=1,
            )
        except BaseException:
            if self._log is not None:
                self._log.close()
            raise
        self.reaped_rc: int | None = None
        self._thread = threading.Thread(
            target=self._pump, name=f"local_cluster-worker-{index}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        """Reads the worker's merged stdout/stderr until EOF."""
        assert self.proc.stdout is not None
        prefix = f"[{self.label}] "
        try:
            for raw in self.proc.stdout:
                line = raw.rstrip("\r\n")
                if self.watch is not None and line.startswith(self.watch):
                    self.seen.set()
                self.tail.append(line)
                self._emit(prefix + line)
                if self._log is not None:
                    self._log.write(line + "\n")
                    self._log.flush()
        except (OSError, ValueError):  # pipe closed under us during teardown
            pass
        finally:
            if self._log is not None:
                self._log.close()

    def poll(self) -> int | None:
        """Returns the exit code if the worker has exited (reaping it), else None."""
        if self.reaped_rc is None:
            self.reaped_rc = self.proc.poll()
        return self.reaped_rc

    def group_alive(self) -> bool:
        """Whether any process of the worker's process group still exists."""
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the worker's whole process group (ignoring a vanished group)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_reader(self, timeout: float) -> None:
        """Waits for the output thread to drain the pipe."""
        self._thread.join(timeout)


class _Emitter:
    """Thread-safe line writer to the launcher's output stream."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # stream closed (e.g. broken pipe): keep going
                pass


def _terminate(workers: Sequence[_Worker], grace_s: float) -> None:
    """SIGTERMs every live worker process group, then SIGKILLs what is left after grace_s.

    A KeyboardInterrupt during the grace period skips straight to SIGKILL and is re-raised
    once everything is dead.
    """
    for w in workers:
        w.poll()
    live = [w for w in workers if w.group_alive()]
    if not live:
        return
    for w in live:
        w.signal_group(signal.SIGTERM)
    interrupted: KeyboardInterrupt | None = None
    deadline = time.monotonic() + max(0.0, grace_s)
    try:
        while live and time.monotonic() < deadline:
            for w in live:
                w.poll()
            live = [w for w in live if w.group_alive()]
            if live:
                time.sleep(_POLL_S)
    except KeyboardInterrupt as e:  # second Ctrl-C: stop waiting, kill now
        interrupted = e
    for w in live:
        w.signal_group(signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=max(5.0, grace_s))
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass
        w.poll()
    if interrupted is not None:
        raise interrupted


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
            link of this rate per direction (see :class:`launch.netem.NetworkCluster`); the
            cluster spec then holds the namespace addresses instead of ``localhost``.
        latency_ms: If set (> 0), the same namespaces with this one-way delay per packet
            (needs the kernel's netem).  Namespaces and links are removed before returning
            (also on failure, timeout or KeyboardInterrupt).

    Returns:
        0 if every worker exited 0; the failing worker's exit code (128 + signal number if
        it was killed by a signal, 1 if out of range) otherwise; 124 on timeout; 127 if a
        worker could not be started.

    Raises:
        ValueError: If ``num_workers < 1``, ``command`` is empty, ``grace_s < 0``,
            ``timeout_s <= 0``, ``bandwidth_mbit <= 0`` or ``latency_ms < 0``.
        launch.netem.NetemUnavailableError: A shaped network was asked for without root,
            without ``ip`` / ``tc``, or (latency) without netem; nothing was started.
        launch.netem.NetemError: The network set-up or tear-down failed.
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

    emit = _Emitter(sys.stdout if stream is None else stream)
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
                                grace_s, emit, timeout_s, keep_gpus)
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
    emit: _Emitter,
    timeout_s: float | None,
    keep_gpus: bool,
) -> int:
    """Starts, watches and tears down the workers (the body of :func:`run_local_cluster`)."""
    workers: list[_Worker] = []
    try:
        for i in range(num_workers):
            log_path = os.path.join(log_dir, f"worker_{i}.log") if log_dir is not None else None
            argv = command if net is None else net.wrap(command, i)
            try:
                workers.append(_Worker(i, argv, worker_env(ports, i, env, keep_gpus, hosts),
                                       log_path, emit))
            except OSError as e:
                emit(f"[launcher] failed to start worker {i}: {e}")
                return START_FAILED_EXIT_CODE

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed: _Worker | None = None
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
            time.sleep(_POLL_S)

        if failed is None:
            return 0
        rc = failed.reaped_rc
        assert rc is not None
        if any(w.poll() is None for w in workers):
            emit(f"[launcher] worker {failed.index} failed; terminating the other workers")
        _terminate(workers, grace_s)
        failed.join_reader(_READER_JOIN_S)
        emit(f"[launcher] worker {failed.index} failed with {_describe_exit(rc)}; last lines:")
        for line in list(failed.tail)[-_TAIL_SHOW:]:
            emit(f"    {line}")
        return _launcher_exit_code(rc)
    finally:
        _terminate(workers, grace_s)
        for w in workers:
            w.join_reader(_READER_JOIN_S)


def define_flags() -> None:
    """Defines the launcher's command-line flags.

    ``--log_dir`` is not defined here: ``absl.logging`` (imported by ``absl.app``) already
    defines it (default ``""``), and the launcher reuses it as "also write each worker's
    output to ``DIR/worker_i.log``".  The launcher itself never logs to files through absl.
    """
    flags.DEFINE_integer("num_workers", 2, "Number of workers to start (>= 1).")
    flags.DEFINE_integer("base_port", 0,
                         "0: pick free ports with portpicker; else first of N consecutive ports.")
    flags.DEFINE_float("grace_s", 10.0, "Seconds between SIGTERM and SIGKILL on teardown.")
    flags.DEFINE_float("timeout_s", 0.0, "If > 0, kill everything after this long (exit 124).")
    flags.DEFINE_bool("keep_gpus", False, "Do not set CUDA_VISIBLE_DEVICES=\"\" for workers.")
    flags.DEFINE_float("bandwidth_mbit", None,
                       "Root only: each worker in its own network namespace on a bridge, its "
                       "link shaped to this many Mbit/s per direction (tc HTB).")
    flags.DEFINE_float("latency_ms", None,
                       "Root only: one-way delay per packet in ms (tc netem; the namespaces as "
                       "for --bandwidth_mbit, which may be left unset).")


def _raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind like Ctrl-C so that the workers get torn down."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str]) -> int:
    """absl entry point; ``argv[1:]`` is the worker command (everything after ``--``)."""
    fl = flags.FLAGS
    command = list(argv[1:])
    if fl.num_workers < 1:
        raise app.UsageError(f"--num_workers must be >= 1, got {fl.num_workers}", exitcode=2)
    if not command:
        raise app.UsageError(
            "a worker command is required after '--' (e.g. -- python train.py)", exitcode=2)
    if fl.grace_s < 0:
        raise app.UsageError(f"--grace_s must be >= 0, got {fl.grace_s}", exitcode=2)
    if fl.timeout_s < 0:
        raise app.UsageError(f"--timeout_s must be >= 0, got {fl.timeout_s}", exitcode=2)
    if fl.bandwidth_mbit is not None and not fl.bandwidth_mbit > 0:
        raise app.UsageError(f"--bandwidth_mbit must be > 0, got {fl.bandwidth_mbit}",
                             exitcode=2)
    if fl.latency_ms is not None and not fl.latency_ms >= 0:
        raise app.UsageError(f"--latency_ms must be >= 0, got {fl.latency_ms}", exitcode=2)
    if fl.base_port and not 1 <= fl.base_port <= 65536 - fl.num_workers:
        raise app.UsageError(f"--base_port={fl.base_port} with --num_workers="
                             f"{fl.num_workers} leaves the port range", exitcode=2)

    # Explicit handlers: SIGINT may be inherited as ignored (background jobs), SIGTERM
    # would otherwise kill the launcher without tearing down the workers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run_local_cluster(
            command,
            num_workers=fl.num_workers,
            log_dir=fl.log_dir or None,
            grace_s=fl.grace_s,
            stream=sys.stdout,
            timeout_s=fl.timeout_s if fl.timeout_s > 0 else None,
            base_port=fl.base_port,
            keep_gpus=fl.keep_gpus,
            bandwidth_mbit=fl.bandwidth_mbit,
            latency_ms=fl.latency_ms,
        )
    except NetemError as e:
        print(f"[launcher] shaped network unavailable or failed: {e}", file=sys.stderr,
              flush=True)
        return 1
    except KeyboardInterrupt:
        print("[launcher] interrupted; all workers terminated", flush=True)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    define_flags()
    app.run(main)
