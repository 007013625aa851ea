"""Bandwidth- and latency-shaped local networks for the local cluster (Linux, root only).

:class:`NetworkCluster` gives every worker its own network namespace, joined through a veth
pair to one bridge that lives in a dedicated namespace of its own::

    <prefix>br:   bridge br0, ports p0, p1, ...       (egress of p_i shaped: what i receives)
       |  veth
    <prefix>w<i>: lo (up) + eth0 = 10.213.x.(i+1)/24  (egress of eth0 shaped: what i sends)

Nothing is created in the root namespace except the names under ``/run/netns``, so the
cluster's subnet is invisible to (and cannot clash with) the host's own addresses; the
default subnet is still chosen to avoid every IPv4 address and route of the root namespace,
so that log lines never look like host addresses.  A worker started with
:meth:`NetworkCluster.wrap` (``ip netns exec <ns> CMD``) sees only ``lo`` and its ``eth0``, so
it talks to the others only over the cluster addresses.

How the links are shaped (one link per worker, or a rate per pair of workers) is
described in :mod:`launch.cluster.shaping`.

``netem`` needs the kernel's ``sch_netem`` (``CONFIG_NET_SCH_NETEM``); where it is missing,
asking for latency raises :class:`NetemUnavailableError` (bandwidth alone needs only HTB).

Tear-down is ``ip netns del`` of every namespace (the kernel then removes the veth pairs and
the bridge with them), after killing any process still inside one.  It runs in ``__exit__``,
at interpreter exit (``atexit``) and on SIGTERM / SIGHUP (when those are not handled already),
is idempotent, and also undoes a set-up that failed halfway.  A run killed with SIGKILL leaves
its namespaces behind: :func:`cleanup_stale` removes them.

    with NetworkCluster(2, bandwidth_mbit=100, latency_ms=1) as net:
        subprocess.run(net.wrap(["python", "worker.py"], 0))
        print(net.worker_address(1))

The measurements (:func:`launch.cluster.probe.measure_link`, ``measure_rtt``) and the
command line (``python -m launch.netem``) live next door.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import subprocess
import threading
from collections.abc import Sequence

from launch.cluster.namespaces import (
    PREFIX_RE,
    PREFIX_ROOT,
    SEQUENCE,
    NetemError,
    NetemUnavailableError,
    check_number,
    check_pairs,
    check_subnet,
    cleanup_stale,
    delete_namespace,
    exit_on_signals,
    netem_supported,
    pick_subnet,
    require_privileges,
    restore_signals,
    run_tool,
)
from launch.cluster.shaping import link_commands, pair_commands

__all__ = ["NetemError", "NetemUnavailableError", "NetworkCluster", "cleanup_stale",
           "netem_supported", "pick_subnet", "require_privileges"]


class NetworkCluster:
    """Per-worker network namespaces on one shaped bridge (a context manager).

    Args:
        num_workers: Number of worker namespaces, ``1 <= num_workers <= hosts of subnet``.
        bandwidth_mbit: Rate of every worker's link in each direction (Mbit/s, 10**6 bit/s);
            ``None``: unshaped.
        latency_ms: One-way delay added to every packet a worker sends (needs netem); the
            round trip between two workers grows by twice this.  0 or ``None``: none.
        pair_mbit: Per-pair link rates instead of one rate per worker: ``pair_mbit[i][j]``
            (Mbit/s, > 0 off the diagonal) is the rate of what worker ``i`` sends to worker
            ``j`` (an HTB class per destination on ``i``'s ``eth0``, chosen by destination
            address).  A ``k x k`` matrix with ``k < num_workers`` shapes only the links among
            workers ``0..k-1``; traffic to or from the others (e.g. a client process) is not
            shaped.  Exclusive with ``bandwidth_mbit``.
        prefix: Namespace-name prefix; default ``tfbs<pid>-<n>-`` (unique in this process,
            recognised by :func:`cleanup_stale`).
        subnet: IPv4 network of the worker addresses (worker ``i`` gets its ``i+1``-th host);
            default: the first ``10.213.<x>.0/24`` clear of the root namespace.
        handle_signals: While set up, turn SIGTERM / SIGHUP into ``SystemExit`` (so that the
            tear-down runs) where those signals still have their default action.

    Raises:
        ValueError: Bad ``num_workers``, ``bandwidth_mbit``, ``latency_ms``, ``prefix`` or
            ``subnet``.
    """

    def __init__(
        self,
        num_workers: int,
        bandwidth_mbit: float | None = None,
        latency_ms: float | None = 0.0,
        prefix: str | None = None,
        subnet: str | None = None,
        handle_signals: bool = True,
        pair_mbit: Sequence[Sequence[float]] | None = None,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self.bandwidth_mbit = check_number("bandwidth_mbit", bandwidth_mbit, False)
        self.latency_ms = check_number("latency_ms", latency_ms, True) or 0.0
        self.pair_mbit = check_pairs(pair_mbit, num_workers)
        if self.pair_mbit is not None and self.bandwidth_mbit is not None:
            raise ValueError("pass either bandwidth_mbit (one rate per worker link) or "
                             "pair_mbit (one rate per pair of workers), not both")
        if prefix is None:
            prefix = f"{PREFIX_ROOT}{os.getpid()}-{next(SEQUENCE)}-"
        if not isinstance(prefix, str) or not PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must match {PREFIX_RE.pattern}, got {prefix!r}")
        self.prefix = prefix
        self._subnet = check_subnet(subnet, num_workers)
        self.handle_signals = handle_signals
        self._ip = self._tc = ""
        self._created: list[str] = []
        self._lock = threading.RLock()
        self._active = False
        self._old_handlers: dict[int, object] = {}

    # ----------------------------------------------------------------- names, addresses
    @property
    def bridge_namespace(self) -> str:
        """The namespace holding the bridge ``br0`` and its ports ``p<i>``."""
        return f"{self.prefix}br"

    def namespace(self, index: int) -> str:
        """Namespace name of worker ``index``."""
        self._check_index(index)
        return f"{self.prefix}w{index}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster: the workers' then the bridge's."""
        return [self.namespace(i) for i in range(self.num_workers)] + [self.bridge_namespace]

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """The worker subnet (picked on set-up when not given)."""
        if self._subnet is None:
            raise RuntimeError("the subnet is picked on set-up: enter the context first")
        return self._subnet

    def worker_address(self, index: int) -> str:
        """IPv4 address of worker ``index`` (its ``eth0``)."""
        self._check_index(index)
        return str(self.subnet.network_address + index + 1)

    def wrap(self, command: Sequence[str], index: int) -> list[str]:
        """``["ip", "netns", "exec", <namespace of index>, *command]``.

        ``ip netns exec`` execs the command in place (same pid, same environment).
        """
        if isinstance(command, (str, bytes)):
            raise ValueError("command must be a sequence of arguments, not a single string")
        return [self._ip or "ip", "netns", "exec", self.namespace(index),
                *(os.fspath(c) for c in command)]

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.num_workers:
            raise ValueError(f"index must be in [0, {self.num_workers}), got {index!r}")

    # ----------------------------------------------------------------- set-up, tear-down
    def __enter__(self) -> NetworkCluster:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        """Creates namespaces, bridge, veth pairs, addresses and qdiscs.

        On any failure (or KeyboardInterrupt) everything created so far is removed before
        the exception propagates.

        Raises:
            NetemUnavailableError: Not root, no ``ip`` / ``tc``, or latency without netem.
            NetemError: A command failed (its stderr is in the message).
        """
        with self._lock:
            if self._active:
                raise RuntimeError("this NetworkCluster is already set up")
            self._ip, self._tc = require_privileges()
            self._active = True
            atexit.register(self.close)
            if self.handle_signals:
                self._old_handlers = exit_on_signals()
            try:
                self._setup()
            except BaseException:
                self.close()
                raise

    def _setup(self) -> None:
        ip, tc = self._ip, self._tc
        if self._subnet is None:
            self._subnet = pick_subnet(ip)
        stale = [ns for ns in self.namespaces if os.path.exists(f"/run/netns/{ns}")]
        if stale:
            raise NetemError(f"namespaces {stale} already exist (a killed run?); remove them "
                             f"with cleanup_stale({self.prefix!r})")
        br = self.bridge_namespace
        self._add_namespace(br)
        if self.latency_ms > 0:
            probe = run_tool([tc, "-n", br, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                          "1ms"], check=False)
            if probe.returncode != 0:
                raise NetemUnavailableError(
                    f"latency_ms={self.latency_ms:g} needs the netem qdisc, which this kernel "
                    f"lacks (CONFIG_NET_SCH_NETEM / module sch_netem; tc said: "
                    f"{probe.stderr.strip()}); drop the latency or use a kernel with netem")
            run_tool([tc, "-n", br, "qdisc", "del", "dev", "lo", "root"])
        run_tool([ip, "-n", br, "link", "add", "br0", "type", "bridge"])
        run_tool([ip, "-n", br, "link", "set", "br0", "up"])
        for i in range(self.num_workers):
            ns, port = self.namespace(i), f"p{i}"
            self._add_namespace(ns)
            run_tool([ip, "-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", ns])
            run_tool([ip, "-n", br, "link", "set", port, "master", "br0", "up"])
            run_tool([ip, "-n", ns, "addr", "add",
                  f"{self.worker_address(i)}/{self.subnet.prefixlen}", "dev", "eth0"])
            run_tool([ip, "-n", ns, "link", "set", "eth0", "up"])
            if self.pair_mbit is None:
                self._shape(tc, ns, "eth0", self.latency_ms)
                self._shape(tc, br, port, 0.0)
        if self.pair_mbit is not None:
            for i in range(self.num_workers):
                self._shape_pairs(tc, i)

    def _add_namespace(self, ns: str) -> None:
        self._created.append(ns)  # before creating: a half-made one is removed too
        run_tool([self._ip, "netns", "add", ns])
        run_tool([self._ip, "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, tc: str, ns: str, dev: str, latency_ms: float) -> None:
        for command in link_commands(tc, ns, dev, self.bandwidth_mbit, latency_ms):
            run_tool(command)

    def _shape_pairs(self, tc: str, index: int) -> None:
        pairs = self.pair_mbit or ()
        if index >= len(pairs):
            return
        addresses = [self.worker_address(j) for j in range(len(pairs[index]))]
        for command in pair_commands(tc, self.namespace(index), index, pairs[index],
                                     addresses, self.latency_ms):
            run_tool(command)

    def close(self) -> None:
        """Removes every namespace this cluster created (idempotent, safe after a failure).

        Processes still running inside them are killed first (otherwise the kernel would
        keep the namespaces, and their links, alive without a name).
        """
        with self._lock:
            if not self._active:
                return
            errors = []
            for ns in reversed(self._created):
                try:
                    delete_namespace(self._ip, ns)
                except (NetemError, OSError, subprocess.SubprocessError) as e:
                    errors.append(str(e))
            self._created = [ns for ns in self._created if os.path.exists(f"/run/netns/{ns}")]
            if errors:
                raise NetemError("tear-down incomplete: " + "; ".join(errors))
            self._active = False
            restore_signals(self._old_handlers)
            self._old_handlers = {}
            with contextlib.suppress(Exception):
                atexit.unregister(self.close)

    # ----------------------------------------------------------------- inspection
    def links(self) -> dict[str, list[str]]:
        """Per namespace of this cluster that exists, its interface names (for tests/debug)."""
        out: dict[str, list[str]] = {}
        for ns in self.namespaces:
            if os.path.exists(f"/run/netns/{ns}"):
                text = run_tool([self._ip or "ip", "-n", ns, "-o", "link", "show"]).stdout
                out[ns] = [line.split(":")[1].strip().split("@")[0]
                           for line in text.splitlines() if line.strip()]
        return out

    def traffic(self) -> list[dict[str, int]]:
        """Per worker, the bytes its ``eth0`` has sent and received so far (kernel counters).

        Traffic a worker sends to its own address stays on its ``lo`` and is not counted, so
        non-zero counters show that workers really talked over the shaped links.
        """
        out = []
        for i in range(self.num_workers):
            text = run_tool([self._ip or "ip", "-n", self.namespace(i), "-s", "-j", "link", "show",
                         "eth0"]).stdout
            stats = json.loads(text)[0]["stats64"]
            out.append({"tx_bytes": int(stats["tx"]["bytes"]),
                        "rx_bytes": int(stats["rx"]["bytes"])})
        return out

    def qdiscs(self, index: int) -> str:
        """``tc qdisc show`` of worker ``index``'s ``eth0`` and of its bridge port."""
        return (run_tool([self._tc or "tc", "-n", self.namespace(index), "qdisc", "show", "dev",
                      "eth0"]).stdout
                + run_tool([self._tc or "tc", "-n", self.bridge_namespace, "qdisc", "show", "dev",
                        f"p{index}"]).stdout)

