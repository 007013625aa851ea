"""Measures a shaped link of a :class:`~launch.cluster.netem.NetworkCluster`: TCP throughput
(:func:`measure_link`) and round trip (:func:`measure_rtt`) between two workers, with small
Python socket programs run inside their namespaces."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from launch.cluster.namespaces import NetemError, check_number
from launch.cluster.netem import NetworkCluster

_RECEIVER = r"""
import json, socket, sys, time
host, seconds, warmup = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
srv = socket.socket()
srv.bind((host, 0))
srv.listen(1)
srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(30)
t_start = t_end = None
n = 0
t_first = None
while True:
    b = conn.recv(1 << 20)
    now = time.perf_counter()
    if not b:
        break
    if t_first is None:
        t_first = now
    elif now - t_first >= warmup:
        if t_start is None:
            t_start = now
        else:
            n += len(b)
            t_end = now
        if now - t_start >= seconds:
            break
conn.close()
print(json.dumps({"bytes": n, "seconds": (t_end or 0) - (t_start or 0)}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
deadline = time.monotonic() + float(sys.argv[3])
buf = b"\0" * (1 << 20)
try:
    while time.monotonic() < deadline:
        c.sendall(buf)
except OSError:
    pass
"""

_ECHO = r"""
import socket, sys
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = conn.recv(64)
    if not b:
        break
    conn.sendall(b)
"""

_PINGER = r"""
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3]) + 1):
    t0 = time.perf_counter()
    c.sendall(b"x")
    if c.recv(64) != b"x":
        raise SystemExit("short echo")
    rtts.append(time.perf_counter() - t0)
print(json.dumps(rtts[1:]), flush=True)
"""


def _pair(net: NetworkCluster, src: int, dst: int, server: str, server_args: Sequence[str],
          client: str, client_args: Sequence[str], timeout_s: float) -> tuple[str, str]:
    """Runs ``server`` in ``dst`` (its first line is the port), then ``client`` in ``src``."""
    if src == dst:
        raise ValueError(f"src and dst must differ, got {src} and {dst}")
    host = net.worker_address(dst)
    srv = subprocess.Popen(net.wrap([sys.executable, "-c", server, host, *server_args], dst),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = None
    try:
        assert srv.stdout is not None
        port = srv.stdout.readline().strip()
        if not port.isdigit():
            err = srv.stderr.read() if srv.stderr else ""
            raise NetemError(f"measurement server failed: {err.strip()}")
        cli = subprocess.Popen(net.wrap([sys.executable, "-c", client, host, port,
                                         *client_args], src),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        s_out, s_err = srv.communicate(timeout=timeout_s)
        c_out, c_err = cli.communicate(timeout=timeout_s)
        if srv.returncode != 0:
            raise NetemError(f"measurement server failed: {s_err.strip()}")
        return s_out, c_out
    finally:
        for p in (srv, cli):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def measure_link(net: NetworkCluster, src: int = 0, dst: int = 1, seconds: float = 1.0,
                 warmup_s: float = 0.3) -> float:
    """Measures TCP throughput from worker ``src`` to worker ``dst``, in Mbit/s.

    One Python sender streams 1 MiB writes for ``warmup_s + seconds`` (plus slack); the
    receiver counts the bytes that arrive during ``seconds`` after a ``warmup_s`` warm-up
    (which hides the token bucket's initial burst and TCP slow start).  Goodput: the TCP/IP
    headers (about 3% at MTU 1500) are not counted, so a shaped link measures a little under
    its rate.  The unshaped figure is bounded by these two Python processes, not the kernel.

    Args:
        net: A set-up cluster.
        src: Sending worker.
        dst: Receiving worker.
        seconds: Measurement window, > 0.
        warmup_s: Discarded start, >= 0.

    Returns:
        Megabits (10**6 bit) per second received.

    Raises:
        ValueError: ``src == dst``, an index out of range, or a bad duration.
        NetemError: A measurement process failed.
    """
    check_number("seconds", seconds, False)
    check_number("warmup_s", warmup_s, True)
    total = seconds + warmup_s
    out, _ = _pair(net, src, dst, _RECEIVER, [str(seconds), str(warmup_s)], _SENDER,
                   [str(total + 10.0)], timeout_s=total + 40.0)
    rec = json.loads(out.strip().splitlines()[-1])
    if rec["seconds"] <= 0:
        raise NetemError(f"no data arrived during the measurement window: {rec}")
    return rec["bytes"] * 8 / rec["seconds"] / 1e6


def measure_rtt(net: NetworkCluster, src: int = 0, dst: int = 1, count: int = 20) -> float:
    """Median TCP round trip (1-byte echo, ``TCP_NODELAY``) from ``src`` to ``dst``, in ms.

    A stand-in for ``ping`` (which needs no extra package this way); it includes two Python
    socket calls per trip, so an unshaped link shows some tens of microseconds.

    Raises:
        ValueError: ``src == dst``, an index out of range, or ``count < 1``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    _, out = _pair(net, src, dst, _ECHO, [], _PINGER, [str(count)], timeout_s=60.0)
    rtts = sorted(json.loads(out.strip().splitlines()[-1]))
    return 1000 * rtts[len(rtts) // 2]
