"""The ``tc`` commands that shape one worker's links (pure: command lines, nothing is run),
and the per-pair rates of a :class:`~tf_blocksparse.planning.Topology`.

:class:`~launch.cluster.netem.NetworkCluster` runs them.  A link direction is an HTB class
of the link's rate (burst: 1 ms at line rate, at least one 64 KiB GSO packet); a latency is
a ``netem`` leaf under that class (or the root qdisc when no rate is given).

One link per worker (:func:`link_commands`): every worker has a full-duplex link of
``bandwidth_mbit`` to a non-blocking switch, as with one NIC per host.  Each direction is
shaped: the worker's ``eth0`` egress (its uplink) and the bridge port's egress (its
downlink).  ``latency_ms`` is a one-way delay added once per packet (under the worker's
uplink class), so the round trip between two workers grows by ``2 * latency_ms``.

A rate per pair (:func:`pair_commands`, e.g. from a
:class:`~tf_blocksparse.planning.Topology`): worker ``i``'s ``eth0`` gets one HTB class per
destination ``j`` at ``pair_mbit[i][j]``, chosen by a ``u32`` filter on the destination
address, so the link ``i -> j`` really carries its own rate (the bridge ports are not
shaped then).
"""

from __future__ import annotations

from collections.abc import Sequence

from launch.cluster.namespaces import NETEM_LIMIT
from tf_blocksparse.planning import Topology

__all__ = ["link_commands", "pair_commands", "rates_topology", "topology_rates"]


def _rate_class(base: list[str], dev: str, classid: str, mbit: float) -> list[str]:
    rate = f"{round(mbit * 1e6)}bit"
    burst = str(max(65536, round(mbit * 1e6 / 8 / 1000)))
    return [*base, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb",
            "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", "65536"]


def _netem(latency_ms: float) -> list[str]:
    return ["netem", "delay", f"{latency_ms:g}ms", "limit", str(NETEM_LIMIT)]


def link_commands(tc: str, ns: str, dev: str, bandwidth_mbit: float | None,
                  latency_ms: float) -> list[list[str]]:
    """Shapes ``dev``'s egress in namespace ``ns``: one rate class and/or a delay.

    Args:
      tc: The ``tc`` binary.
      ns: Network namespace of ``dev``.
      dev: Interface whose egress is shaped.
      bandwidth_mbit: The link's rate; ``None``: not rate-limited.
      latency_ms: One-way delay added per packet; 0: none.

    Returns:
      The command lines, in order (empty when neither is asked for).
    """
    base = [tc, "-n", ns]
    if bandwidth_mbit is not None:
        out = [[*base, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default",
                "1"], _rate_class(base, dev, "1:1", bandwidth_mbit)]
        if latency_ms > 0:
            out.append([*base, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                        *_netem(latency_ms)])
        return out
    if latency_ms > 0:
        return [[*base, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                 *_netem(latency_ms)]]
    return []


def pair_commands(tc: str, ns: str, index: int, rates_mbit: Sequence[float],
                  addresses: Sequence[str], latency_ms: float) -> list[list[str]]:
    """One rate class per destination on worker ``index``'s ``eth0`` (per-pair rates).

    Traffic to or from hosts outside the matrix is neither shaped nor delayed (HTB
    ``default 0`` sends unclassified packets straight through).

    Args:
      tc: The ``tc`` binary.
      ns: Worker ``index``'s namespace.
      index: The worker.
      rates_mbit: Per destination worker ``j``, the rate of the link ``index -> j``.
      addresses: Per worker, its cluster address (the filter's destination).
      latency_ms: One-way delay per packet on every pair; 0: none.
    """
    base = [tc, "-n", ns]
    out = [[*base, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default",
            "0"]]
    for dst, mbit in enumerate(rates_mbit):
        if dst == index:
            continue
        cls = f"1:{dst + 10:x}"
        out.append(_rate_class(base, "eth0", cls, mbit))
        if latency_ms > 0:
            out.append([*base, "qdisc", "add", "dev", "eth0", "parent", cls, "handle",
                        f"{dst + 10:x}:", *_netem(latency_ms)])
        out.append([*base, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                    "prio", "1", "u32", "match", "ip", "dst", f"{addresses[dst]}/32",
                    "flowid", cls])
    return out


def topology_rates(topology: Topology, fastest_mbit: float) -> list[list[float]]:
    """Per-pair link rates (Mbit/s) with ``topology``'s proportions, fastest link scaled to
    ``fastest_mbit``.

    Raises:
        ValueError: ``fastest_mbit`` is not > 0 or the topology has one device.
    """
    if not fastest_mbit > 0:
        raise ValueError(f"fastest_mbit must be > 0, got {fastest_mbit!r}")
    if topology.num_devices < 2:
        raise ValueError("topology needs at least 2 devices to shape links between them")
    top = max(max(row) for row in topology.bandwidth)
    return [[0.0 if a == b else fastest_mbit * bw / top for b, bw in enumerate(row)]
            for a, row in enumerate(topology.bandwidth)]


def rates_topology(pair_mbit: Sequence[Sequence[float]]) -> Topology:
    """The :class:`Topology` (bytes/s) that per-pair rates in Mbit/s describe."""
    return Topology([[0.0 if a == b else float(v) * 1e6 / 8 for b, v in enumerate(row)]
                     for a, row in enumerate(pair_mbit)])
