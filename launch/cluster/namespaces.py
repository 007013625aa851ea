"""Network namespaces of the shaped local cluster: tools, privileges, subnets, clean-up,
and the checks of its rates.

The helpers under :class:`launch.cluster.netem.NetworkCluster`: finding ``ip`` / ``tc``
(root only), running them, listing and deleting the cluster's namespaces (killing what still
runs inside), removing the leftovers of killed runs (:func:`cleanup_stale`), choosing a
subnet that clashes with nothing on the host, and probing for the kernel's ``netem``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from tf_blocksparse.launcher.processes import pid_alive

#: Default namespace-name prefix root; a cluster's prefix is ``tfbs<pid>-<n>-``.
PREFIX_ROOT = "tfbs"
#: First candidate subnet; the default picks ``10.213.<x>.0/24`` clear of the root namespace.
DEFAULT_SUBNET_BASE = "10.213.0.0/16"
#: netem queue length (packets): large enough for 10 Gbit/s x 100 ms without drops.
NETEM_LIMIT = 100_000

_STALE_RE = re.compile(rf"^{PREFIX_ROOT}(\d+)-\d+-(?:w\d+|br)$")
#: What a namespace-name prefix may look like.
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Numbers the clusters of this process (part of their default prefix).
SEQUENCE = itertools.count()
_CMD_TIMEOUT_S = 30.0


class NetemError(RuntimeError):
    """A namespace, link or ``tc`` command failed."""


class NetemUnavailableError(NetemError):
    """Network namespaces / shaping cannot be used here (not root, no ``ip``/``tc``, no netem)."""


def _tool(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None)
    if path is None:
        raise NetemUnavailableError(
            f"`{name}` (iproute2) was not found on PATH or in /usr/sbin, /sbin; install "
            "iproute2 to use a shaped network")
    return path


def require_privileges() -> tuple[str, str]:
    """Checks that namespaces and ``tc`` can be used; returns the ``ip`` and ``tc`` paths.

    Raises:
        NetemUnavailableError: Not Linux, not root, or ``ip`` / ``tc`` missing.
    """
    if not sys.platform.startswith("linux"):
        raise NetemUnavailableError(
            f"a shaped network needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetemUnavailableError(
            "a shaped network (--bandwidth_mbit / --latency_ms) needs root: it creates network "
            "namespaces, veth pairs, a bridge and tc qdiscs; run as root (e.g. sudo) or drop "
            f"those flags (euid is {os.geteuid()})")
    return _tool("ip"), _tool("tc")


def run_tool(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs one ``ip``/``tc`` command; raises :class:`NetemError` with its stderr on failure."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        cls = NetemUnavailableError if "kind is unknown" in msg else NetemError
        raise cls(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {msg}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``, without the ids)."""
    ip, _ = require_privileges()
    out = run_tool([ip, "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(ip: str, ns: str) -> list[int]:
    out = run_tool([ip, "netns", "pids", ns], check=False).stdout
    return [int(t) for t in out.split() if t.isdigit()]


def delete_namespace(ip: str, ns: str, kill: bool = True) -> bool:
    """Kills what still runs inside ``ns`` (if ``kill``) and deletes it; False if absent."""
    if not os.path.exists(os.path.join("/run/netns", ns)):
        return False
    if kill:
        for pid in _namespace_pids(ip, ns):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    proc = run_tool([ip, "netns", "del", ns], check=False)
    if proc.returncode != 0 and os.path.exists(os.path.join("/run/netns", ns)):
        raise NetemError(f"could not delete namespace {ns}: {proc.stderr.strip()}")
    return True


def cleanup_stale(prefix: str | None = None) -> list[str]:
    """Removes namespaces left behind by killed runs (and the links inside them).

    Args:
        prefix: ``None`` removes every ``tfbs<pid>-<n>-w<i>`` / ``...-br`` namespace (the
            default naming) whose ``<pid>`` no longer runs; a string removes exactly the
            namespaces ``<prefix>w<i>`` and ``<prefix>br`` of that prefix, whoever made them.

    Returns:
        The names removed.  Processes still inside a removed namespace are killed.

    Raises:
        NetemUnavailableError: Not root or no ``ip``.
        ValueError: If ``prefix`` is empty or has characters other than ``[A-Za-z0-9_.-]``.
    """
    if prefix is not None and not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must match {PREFIX_RE.pattern}, got {prefix!r}")
    ip, _ = require_privileges()
    removed = []
    for ns in list_namespaces():
        if prefix is None:
            m = _STALE_RE.match(ns)
            if not m or pid_alive(int(m.group(1))):
                continue
        elif not re.fullmatch(re.escape(prefix) + r"(?:w\d+|br)", ns):
            continue
        if delete_namespace(ip, ns):
            removed.append(ns)
    return removed


def _root_networks(ip: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the root namespace's addresses and routes (default route excluded)."""
    nets = []
    for argv in ([ip, "-4", "-o", "addr", "show"], [ip, "-4", "route", "show", "table", "all"]):
        for tok in run_tool(argv, check=False).stdout.split():
            if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", tok):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(tok, strict=False))
    return nets


def pick_subnet(ip: str | None = None) -> ipaddress.IPv4Network:
    """The first ``10.213.<x>.0/24`` that overlaps no address or route of the root namespace.

    Raises:
        NetemError: If all 256 candidates overlap.
    """
    taken = _root_networks(ip or require_privileges()[0])
    for cand in ipaddress.ip_network(DEFAULT_SUBNET_BASE).subnets(new_prefix=24):
        if not any(cand.overlaps(t) for t in taken):
            return cand
    raise NetemError(f"every /24 of {DEFAULT_SUBNET_BASE} overlaps a root-namespace route")


def netem_supported() -> bool:
    """Whether the kernel has the ``netem`` qdisc (needed for ``latency_ms > 0``).

    Probes with a throw-away namespace (created and removed here).

    Raises:
        NetemUnavailableError: Not root or no ``ip`` / ``tc``.
    """
    ip, tc = require_privileges()
    ns = f"{PREFIX_ROOT}{os.getpid()}-{next(SEQUENCE)}-br"  # cleanup_stale() finds it if killed
    run_tool([ip, "netns", "add", ns])
    try:
        proc = run_tool([tc, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                         "1ms"], check=False)
        return proc.returncode == 0
    finally:
        delete_namespace(ip, ns)


def check_number(name: str, value: float | None, allow_zero: bool) -> float | None:
    """``value`` as a finite float > 0 (>= 0 with ``allow_zero``); ``None`` stays ``None``.

    Raises:
        ValueError: Naming ``name``, for anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0 or (value == 0.0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, "
                         f"got {value!r}")
    return value


def check_pairs(pair_mbit: Sequence[Sequence[float]] | None,
                 num_workers: int) -> tuple[tuple[float, ...], ...] | None:
    """Validates a per-pair rate matrix (diagonal ignored, stored as 0)."""
    if pair_mbit is None:
        return None
    try:
        rows = [list(r) for r in pair_mbit]
    except TypeError:
        raise ValueError("pair_mbit must be a square matrix (list of lists) of Mbit/s") \
            from None
    k = len(rows)
    if not 2 <= k <= num_workers or any(len(r) != k for r in rows):
        raise ValueError(f"pair_mbit must be a k x k matrix with 2 <= k <= num_workers="
                         f"{num_workers}, got row lengths {[len(r) for r in rows]}")
    out = []
    for i, row in enumerate(rows):
        vals = []
        for j, v in enumerate(row):
            vals.append(0.0 if i == j else check_number(f"pair_mbit[{i}][{j}]", v, False))
        out.append(tuple(vals))
    return tuple(out)


def check_subnet(subnet: str | None, num_workers: int) -> ipaddress.IPv4Network | None:
    """``subnet`` as an IPv4 network with room for ``num_workers`` hosts (``None``: picked at
    set-up, which needs ``num_workers <= 253`` for its /24).

    Raises:
        ValueError: Naming ``subnet`` (or ``num_workers`` for the default /24).
    """
    if subnet is None:
        if num_workers > 253:
            raise ValueError(f"num_workers must be <= 253 with the default /24 subnet, got "
                             f"{num_workers}; pass a larger subnet")
        return None
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise ValueError(f"subnet must be an IPv4 network like 10.213.0.0/24: {e}") from None
    if net.version != 4 or net.num_addresses - 2 < num_workers:
        raise ValueError(f"subnet {subnet} has no room for {num_workers} workers")
    return net


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM / SIGHUP handler: unwind (so that ``__exit__`` / ``atexit`` tear down)."""
    raise SystemExit(128 + signum)


def exit_on_signals() -> dict[int, object]:
    """Turns SIGTERM / SIGHUP into ``SystemExit`` where they still have their default action
    (main thread only), so that a cluster's tear-down runs.

    Returns:
        The handlers replaced, for :func:`restore_signals`.
    """
    old: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                old[sig] = signal.signal(sig, _exit_on_signal)
    return old


def restore_signals(old: dict[int, object]) -> None:
    """Puts back the handlers :func:`exit_on_signals` replaced (those still its own)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in old.items():
        with contextlib.suppress(ValueError, TypeError):
            if signal.getsignal(sig) is _exit_on_signal:
                signal.signal(sig, handler)  # type: ignore[arg-type]
