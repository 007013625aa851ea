"""Worker processes of the local launchers: start, stream, watch, tear down.

A :class:`WorkerProcess` runs one command in its own process group and streams its output
line by line (prefixed ``[<label>] ``) through an :class:`Emitter`, keeping the last lines
for a failure message; :func:`terminate` stops a set of them (SIGTERM to each group, SIGKILL
after a grace period).  Used by :func:`tf_blocksparse.launcher.run_local_cluster` (``tfbs-run``)
and, in the repository, by ``launch.cluster`` (shaped networks, TF server clusters).
Standard library only.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

TAIL_KEEP = 50  # lines of each worker's output kept in memory
POLL_S = 0.05
READER_JOIN_S = 5.0


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one that belongs to another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_exit(returncode: int) -> str:
    """Human-readable exit status (``exit code 3`` or ``exit code -9 (SIGKILL)``)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exit code {returncode} ({name})"
    return f"exit code {returncode}"


def launcher_exit_code(returncode: int) -> int:
    """Maps a failing worker's return code to the launcher's (non-zero) exit code."""
    if returncode < 0:
        return 128 + (-returncode)
    if 0 < returncode < 256:
        return returncode
    return 1


class WorkerProcess:
    """One worker subprocess plus the thread that streams its output."""

    def __init__(
        self,
        index: int,
        command: Sequence[str],
        env: Mapping[str, str],
        log_path: str | None,
        emit: Emitter,
        label: str | None = None,
        watch: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.index = index
        self.label = label or f"worker {index}"
        self.watch = watch
        self.seen = threading.Event()  # set once a line starting with ``watch`` arrives
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_KEEP)
        self._emit = emit
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None
        try:
            self.proc = subprocess.Popen(
                list(command),
                env=dict(env),
                cwd=cwd,
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
            target=self._pump, name=f"worker-process-{index}", daemon=True)
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


class Emitter:
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


def terminate(workers: Sequence[WorkerProcess], grace_s: float) -> None:
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
                time.sleep(POLL_S)
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
