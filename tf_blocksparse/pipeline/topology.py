"""Cluster model for the planners: devices and pairwise bandwidths.

A :class:`Topology` is a symmetric matrix of link bandwidths in bytes/s between every pair of
devices; the diagonal is ignored (stored as 0).  Builders make homogeneous, two-level
(intra-node / inter-node) and random heterogeneous clusters.  Pure Python (numpy only).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Topology", "homogeneous", "random_heterogeneous", "two_level"]


@dataclass(frozen=True)
class Topology:
    """Devices ``0..n-1`` and the bandwidth of every link.

    Attributes:
        bandwidth: ``bandwidth[a][b]``: bytes/s between devices ``a`` and ``b``; square,
            symmetric, finite and > 0 off the diagonal.  The diagonal is ignored (may be given
            as 0 or inf) and stored as 0.0.  Any nested sequence is accepted and stored as a
            tuple of tuples of floats.
        names: Optional device names (default ``device_<i>``).
    """

    bandwidth: tuple[tuple[float, ...], ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            rows = [list(r) for r in self.bandwidth]
        except TypeError as err:
            raise ValueError("Topology: bandwidth must be a list of lists") from err
        n = len(rows)
        if n == 0 or any(len(r) != n for r in rows):
            raise ValueError(f"Topology: bandwidth must be a non-empty square matrix, got {n} "
                             f"rows of lengths {[len(r) for r in rows]}")
        mat: list[tuple[float, ...]] = []
        for a, row in enumerate(rows):
            out = []
            for b, v in enumerate(row):
                if a == b:
                    out.append(0.0)
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float, np.integer,
                                                             np.floating)):
                    raise ValueError(f"Topology: bandwidth[{a}][{b}] must be a number")
                v = float(v)
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(f"Topology: bandwidth[{a}][{b}] = {v} must be finite and "
                                     "> 0 off the diagonal")
                out.append(v)
            mat.append(tuple(out))
        for a in range(n):
            for b in range(a):
                if not math.isclose(mat[a][b], mat[b][a], rel_tol=1e-9):
                    raise ValueError(f"Topology: bandwidth must be symmetric: [{a}][{b}] = "
                                     f"{mat[a][b]} != [{b}][{a}] = {mat[b][a]}")
        names = tuple(self.names) if self.names else tuple(f"device_{i}" for i in range(n))
        if len(names) != n or not all(isinstance(s, str) for s in names):
            raise ValueError(f"Topology: names must be {n} strings")
        if len(set(names)) != n:
            raise ValueError("Topology: names must be distinct")
        object.__setattr__(self, "bandwidth", tuple(mat))
        object.__setattr__(self, "names", names)

    @property
    def num_devices(self) -> int:
        """Number of devices D."""
        return len(self.bandwidth)

    def link(self, a: int, b: int) -> float:
        """Bandwidth (bytes/s) between distinct devices ``a`` and ``b``."""
        if a == b:
            raise ValueError(f"link: a device has no link to itself ({a})")
        return self.bandwidth[a][b]

    def total_bandwidth(self, d: int) -> float:
        """Sum of device ``d``'s link bandwidths (its row without the diagonal).

        Summed with :func:`math.fsum` (correctly rounded), so devices whose links have the same
        values in any order get bit-identical totals and tie exactly.
        """
        return math.fsum(self.bandwidth[d])

    def bandwidth_order(self) -> tuple[int, ...]:
        """Device ids by total bandwidth, highest first; ties by lower id (the planner's order)."""
        totals = [self.total_bandwidth(d) for d in range(self.num_devices)]
        return tuple(sorted(range(self.num_devices), key=lambda d: (-totals[d], d)))

    def hierarchy(self, rtol: float = 1e-9) -> tuple[tuple[int, ...],
                                                     tuple[tuple[int, float], ...]] | None:
        """The cluster as uniform nested levels (nodes, groups of nodes, ...), if it is one.

        Level 1's components (the *nodes*) are the groups of devices whose mutual bandwidth is
        the largest link bandwidth ``B_1``: the connected components of the links within
        ``rtol`` of it.  Level ``k`` joins level-``(k-1)`` components over the links of the
        next distinct bandwidth ``B_k``, until one component holds every device.  The topology
        is a hierarchy when at every level each component joins the same number ``m_k`` of
        level-``(k-1)`` components and every link between two of them has bandwidth ``B_k``
        (within ``rtol``).  :meth:`homogeneous` gives the one-level hierarchy ``((n, B),)``
        and :meth:`two_level` ``((devices_per_node, intra_bw), (nodes, inter_bw))``; random
        links are no hierarchy.

        Args:
            rtol: Relative tolerance under which two bandwidths count as equal.

        Returns:
            ``(order, levels)``: ``order`` lists every device component by component at every
            level (components by lowest id, so each level-``k`` component is a contiguous
            block of ``m_1 ... m_k`` entries); ``levels[k-1] = (m_k, B_k)`` from the innermost
            level out, ``B_1 > B_2 > ...``.  ``None`` for one device or no hierarchy.
        """
        n = self.num_devices
        if n < 2:
            return None
        bands: list[list[float]] = []  # distinct bandwidths, highest first, merged by rtol
        for v in sorted(set(self.off_diagonal().tolist()), reverse=True):
            if bands and math.isclose(v, bands[-1][0], rel_tol=rtol):
                bands[-1].append(v)
            else:
                bands.append([v])
        comps: list[tuple[int, ...]] = [(d,) for d in range(n)]
        levels: list[tuple[int, float]] = []
        for band in bands:
            lo, hi = band[-1], band[0]
            groups = _join(self.bandwidth, comps, lo)
            fan_out = {len(g) for g in groups}
            if len(fan_out) != 1:
                return None
            for g in groups:
                for p, q in itertools.combinations(g, 2):
                    if any(not lo <= self.bandwidth[a][b] <= hi
                           for a in comps[p] for b in comps[q]):
                        return None
            levels.append((fan_out.pop(), hi))
            comps = [tuple(d for c in g for d in comps[c]) for g in groups]
        return comps[0], tuple(levels)

    def ring_bandwidth(self, devices: Sequence[int]) -> float:
        """Slowest edge of the ring ``d_0 -> d_1 -> ... -> d_{r-1} -> d_0`` (inf for r = 1)."""
        devices = tuple(devices)
        if len(devices) < 2:
            return math.inf
        return min(self.bandwidth[devices[t]][devices[(t + 1) % len(devices)]]
                   for t in range(len(devices)))

    def off_diagonal(self) -> np.ndarray:
        """All link bandwidths (each pair once); empty for one device."""
        m = np.array(self.bandwidth, dtype=float)
        return m[np.triu_indices(self.num_devices, k=1)]

    def mean_bandwidth(self) -> float:
        """Mean link bandwidth (inf for one device)."""
        links = self.off_diagonal()
        return float(links.mean()) if links.size else math.inf

    def min_bandwidth(self) -> float:
        """Slowest link (inf for one device)."""
        links = self.off_diagonal()
        return float(links.min()) if links.size else math.inf

    def to_json(self) -> str:
        """Serialises the topology; ``Topology.from_json(t.to_json()) == t``."""
        return json.dumps({"bandwidth": [list(r) for r in self.bandwidth],
                           "names": list(self.names)})

    @classmethod
    def from_json(cls, text: str) -> Topology:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        return cls(bandwidth=d["bandwidth"], names=tuple(d.get("names", ())))

    @classmethod
    def homogeneous(cls, n: int, bandwidth: float) -> Topology:
        """``n`` devices, every link ``bandwidth`` bytes/s."""
        _check_count("n", n)
        return cls([[float(bandwidth)] * n for _ in range(n)])

    @classmethod
    def two_level(cls, nodes: int, devices_per_node: int, intra_bw: float,
                  inter_bw: float) -> Topology:
        """``nodes`` hosts of ``devices_per_node`` devices each.

        Device ``node * devices_per_node + k`` is device ``k`` of host ``node`` (named
        ``node<node>/dev<k>``); links inside a host have ``intra_bw``, across hosts ``inter_bw``.
        """
        _check_count("nodes", nodes)
        _check_count("devices_per_node", devices_per_node)
        n = nodes * devices_per_node
        bw = [[float(intra_bw if a // devices_per_node == b // devices_per_node else inter_bw)
               for b in range(n)] for a in range(n)]
        names = tuple(f"node{a // devices_per_node}/dev{a % devices_per_node}" for a in range(n))
        return cls(bw, names)

    @classmethod
    def random_heterogeneous(cls, n: int, base_bandwidth: float, spread: float = 0.8,
                             seed: int = 0) -> Topology:
        """``n`` devices with pairwise bandwidths uniform in ``[(1-spread), 1] * base``.

        So the slowest link is at least ``(1 - spread)`` times the fastest (links differ by up
        to ``spread``, e.g. ~80%).  Symmetric, deterministic per ``seed``.
        """
        _check_count("n", n)
        if not 0 <= spread < 1:
            raise ValueError(f"spread must be in [0, 1), got {spread}")
        if not (math.isfinite(base_bandwidth) and base_bandwidth > 0):
            raise ValueError(f"base_bandwidth must be finite and > 0, got {base_bandwidth}")
        rng = np.random.default_rng(seed)
        m = np.zeros((n, n))
        iu = np.triu_indices(n, k=1)
        m[iu] = base_bandwidth * rng.uniform(1 - spread, 1, len(iu[0]))
        m = m + m.T
        return cls(m.tolist())


def _join(bandwidth: Sequence[Sequence[float]], comps: Sequence[tuple[int, ...]],
          threshold: float) -> list[list[int]]:
    """Groups of ``comps`` (indices) connected by links of at least ``threshold`` bytes/s.

    ``comps`` are sorted by their lowest device; so are the groups and their members.
    """
    label = {d: c for c, comp in enumerate(comps) for d in comp}
    parent = list(range(len(comps)))

    def root(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    n = len(bandwidth)
    for a in range(n):
        for b in range(a + 1, n):
            if bandwidth[a][b] >= threshold:
                parent[root(label[a])] = root(label[b])
    groups: dict[int, list[int]] = {}
    for c in range(len(comps)):
        groups.setdefault(root(c), []).append(c)
    return sorted(groups.values(), key=lambda g: g[0])


def _check_count(arg: str, value: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{arg} must be an int >= 1, got {value!r}")


def homogeneous(n: int, bandwidth: float) -> Topology:
    """Module-level alias of :meth:`Topology.homogeneous`."""
    return Topology.homogeneous(n, bandwidth)


def two_level(nodes: int, devices_per_node: int, intra_bw: float, inter_bw: float) -> Topology:
    """Module-level alias of :meth:`Topology.two_level`."""
    return Topology.two_level(nodes, devices_per_node, intra_bw, inter_bw)


def random_heterogeneous(n: int, base_bandwidth: float, spread: float = 0.8,
                         seed: int = 0) -> Topology:
    """Module-level alias of :meth:`Topology.random_heterogeneous`."""
    return Topology.random_heterogeneous(n, base_bandwidth, spread, seed)
