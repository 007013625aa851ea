"""Per-process memory and CPU caps with the kernel's cgroup v1 controllers (Linux, root only).

A :class:`ResourceCap` is one cgroup in the ``memory`` and/or the ``cpu`` hierarchy under
``/sys/fs/cgroup``:

- memory: a hard limit on the memory (and, where swap accounting is on, memory + swap) of the
  processes inside.  A process that needs more is killed by the kernel's out-of-memory killer,
  which the cgroup counts (``oom_kill`` in ``memory.oom_control``): :meth:`ResourceCap.oom_kills`
  tells a launcher *why* a capped process died;
- cpu: a CFS bandwidth quota of ``cpus`` CPUs (``cpu.cfs_quota_us`` per ``cpu.cfs_period_us``),
  so that processes sharing a small machine each get a fixed compute budget, like separate
  hosts.

Processes join the cgroups before they allocate anything: :meth:`ResourceCap.wrap` prefixes a
command with a tiny shell that writes its own pid into each ``cgroup.procs`` and then
``exec``\\ s the command (same pid).  Put it outside ``ip netns exec``
(:mod:`launch.cluster.netem`), which remounts ``/sys``.

Tear-down (:meth:`ResourceCap.close`: kill what is still inside, ``rmdir``) runs on
``__exit__`` and at interpreter exit, and is idempotent; :func:`cleanup_stale` removes the
cgroups of runs that were killed with SIGKILL.

    with ResourceCap(memory_bytes=512 * 2**20, cpus=0.5) as cap:
        subprocess.run(cap.wrap(["python", "worker.py"]))
        print(cap.oom_kills(), cap.peak_bytes())
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence

from tf_blocksparse.launcher.processes import pid_alive

#: Where the cgroup v1 hierarchies are mounted (``memory``, ``cpu`` below it).
CGROUP_ROOT = "/sys/fs/cgroup"
#: Name prefix root of the cgroups made here: ``tfbs<pid>-<n>``.
PREFIX_ROOT = "tfbs"
#: CFS period of the CPU quotas (microseconds): short, so that a throttled process waits
#: at most a few milliseconds (a long period makes short ops jitter by up to its length).
CPU_PERIOD_US = 10_000

_SEQ = itertools.count()
_STALE_RE = re.compile(rf"^{PREFIX_ROOT}(\d+)-\d+$")
_CONTROLLERS = {"memory": "memory.limit_in_bytes", "cpu": "cpu.cfs_quota_us"}


class CgroupUnavailableError(RuntimeError):
    """A cgroup v1 controller cannot be used here (not Linux, not root, not mounted)."""


def require_controller(controller: str, root: str = CGROUP_ROOT) -> str:
    """Checks that cgroups of ``controller`` (``"memory"`` or ``"cpu"``) can be made.

    Returns:
        The controller's mount point.

    Raises:
        CgroupUnavailableError: Not Linux, not root, or the v1 controller is not mounted.
    """
    if not sys.platform.startswith("linux"):
        raise CgroupUnavailableError(f"{controller} caps need Linux cgroups; this is "
                                     f"{sys.platform}")
    if os.geteuid() != 0:
        raise CgroupUnavailableError(
            f"{controller} caps need root: they create cgroups under {root}; run as root or "
            f"drop the {controller} cap flags (euid is {os.geteuid()})")
    path = os.path.join(root, controller)
    if not os.path.exists(os.path.join(path, _CONTROLLERS[controller])):
        raise CgroupUnavailableError(
            f"the cgroup v1 {controller} controller is not mounted at {path} (cgroup "
            f"v2-only hosts are not supported); drop the {controller} cap flags")
    return path


def _kill_all(path: str) -> None:
    """SIGKILLs every process of the cgroup at ``path`` and waits (<= 5 s) until it is empty."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            with open(os.path.join(path, "cgroup.procs")) as fh:
                pids = [int(t) for t in fh.read().split()]
        except FileNotFoundError:
            return
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _remove(path: str) -> None:
    _kill_all(path)
    deadline = time.monotonic() + 5.0
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the killed processes exit
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def cleanup_stale(root: str = CGROUP_ROOT) -> list[str]:
    """Removes ``tfbs<pid>-<n>`` cgroups whose creating process no longer runs.

    Returns:
        The paths removed (processes still inside are killed first).
    """
    removed = []
    for controller in _CONTROLLERS:
        base = os.path.join(root, controller)
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            m = _STALE_RE.match(name)
            if m and not pid_alive(int(m.group(1))):
                _remove(os.path.join(base, name))
                removed.append(os.path.join(base, name))
    return removed


def _check_cpus(cpus: float | None) -> float | None:
    if cpus is None:
        return None
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0.01 <= cpus <= 1024:
        raise ValueError(f"cpus must be a number in [0.01, 1024] or None, got {cpus!r}")
    return float(cpus)


class ResourceCap:
    """One cgroup with a memory limit and/or a CPU quota (a context manager).

    Args:
        memory_bytes: The memory cap, > 0, or ``None``: memory of all processes inside (and
            memory + swap where the kernel accounts swap, so the cap cannot be dodged by
            swapping).
        cpus: CPU quota in CPUs (e.g. 0.5: half of one CPU's time per period), or ``None``.
        name: Cgroup name; default ``tfbs<pid>-<n>`` (found by :func:`cleanup_stale` if this
            process is killed).
        root: Where the v1 hierarchies are mounted.

    Raises:
        ValueError: Bad ``memory_bytes``, ``cpus`` or ``name``, or neither cap given.
    """

    def __init__(self, memory_bytes: int | None = None, cpus: float | None = None,
                 name: str | None = None, root: str = CGROUP_ROOT) -> None:
        if memory_bytes is not None and (isinstance(memory_bytes, bool)
                                         or not isinstance(memory_bytes, int)
                                         or memory_bytes <= 0):
            raise ValueError(f"memory_bytes must be an int > 0 or None, got {memory_bytes!r}")
        self.cpus = _check_cpus(cpus)
        if memory_bytes is None and self.cpus is None:
            raise ValueError("give memory_bytes and/or cpus")
        name = name or f"{PREFIX_ROOT}{os.getpid()}-{next(_SEQ)}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
        self.memory_bytes = memory_bytes
        self.name = name
        self._root = root
        self.paths: dict[str, str] = {}
        self._active = False
        self._lock = threading.Lock()

    @property
    def controllers(self) -> list[str]:
        """The controllers this cap uses."""
        return [c for c, on in (("memory", self.memory_bytes is not None),
                                ("cpu", self.cpus is not None)) if on]

    def __enter__(self) -> ResourceCap:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        """Creates the cgroups and sets their limits.

        Raises:
            CgroupUnavailableError: See :func:`require_controller`.
            FileExistsError: A cgroup of that name exists already.
        """
        bases = {c: require_controller(c, self._root) for c in self.controllers}
        with self._lock:
            if self._active:
                raise RuntimeError("this ResourceCap is already set up")
            self._active = True
            atexit.register(self.close)
            try:
                for c, base in bases.items():
                    path = os.path.join(base, self.name)
                    os.mkdir(path)
                    self.paths[c] = path
                if self.memory_bytes is not None:
                    self._write("memory", "memory.limit_in_bytes", self.memory_bytes)
                    if os.path.exists(os.path.join(self.paths["memory"],
                                                   "memory.memsw.limit_in_bytes")):
                        self._write("memory", "memory.memsw.limit_in_bytes", self.memory_bytes)
                if self.cpus is not None:
                    self._write("cpu", "cpu.cfs_period_us", CPU_PERIOD_US)
                    self._write("cpu", "cpu.cfs_quota_us", round(self.cpus * CPU_PERIOD_US))
            except BaseException:
                self._active = True
                self._close_locked()
                raise

    def _write(self, controller: str, key: str, value: int) -> None:
        with open(os.path.join(self.paths[controller], key), "w") as fh:
            fh.write(str(value))

    def _read(self, controller: str, key: str) -> str:
        with open(os.path.join(self.paths[controller], key)) as fh:
            return fh.read()

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the cgroups from its first instruction (same pid, via exec)."""
        if isinstance(command, (str, bytes)):
            raise ValueError("command must be a sequence of arguments, not a single string")
        if not self.paths:
            raise RuntimeError("set the cap up first (use it as a context manager)")
        joins = " && ".join(f'echo $$ > "{os.path.join(p, "cgroup.procs")}"'
                            for p in self.paths.values())
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh",
                *(os.fspath(c) for c in command)]

    def add(self, pid: int) -> None:
        """Moves a running process into the cgroups (memory it already has stays charged
        elsewhere)."""
        for c in self.paths:
            self._write(c, "cgroup.procs", pid)

    def usage_bytes(self) -> int:
        """Memory charged to the cgroup now."""
        return int(self._read("memory", "memory.usage_in_bytes"))

    def peak_bytes(self) -> int:
        """The highest memory charged to the cgroup so far."""
        return int(self._read("memory", "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        """How many processes of the cgroup the out-of-memory killer has killed (0 without a
        memory cap)."""
        if "memory" not in self.paths or not os.path.isdir(self.paths["memory"]):
            return 0
        for line in self._read("memory", "memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return int(self._read("memory", "memory.failcnt").strip() != "0")  # old kernels

    def close(self) -> None:
        """Kills what still runs inside and removes the cgroups (idempotent)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self._active:
            return
        for path in self.paths.values():
            _remove(path)
        self.paths = {}
        self._active = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
