"""Heterogeneous-network-aware pipeline partitioning and placement.

:func:`plan_pipeline` is the project's pipeline planner: order the devices by total bandwidth
(highest first, ties by lower id), then a min-max dynamic program with backtracking over
consecutive layer ranges x runs of consecutive devices of that order, minimising the largest
stage time of the cost model in :mod:`~tf_blocksparse.pipeline.plan`.  A stage's run may
start after unused devices (gaps), so its search space contains every "consecutive runs"
assignment.  :func:`plan_exhaustive` enumerates that same space and :func:`plan_bruteforce`
every device subset and ring order, for checks on small cases.  Pure Python + numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from .plan import PipelinePlan, make_plan
from .profile import ModelProfile
from .stage_cost import stage_time
from .topology import Topology

__all__ = ["plan_bruteforce", "plan_exhaustive", "plan_pipeline"]

METHOD = "bandwidth_dp"
_TIE_RTOL = 1e-12  # plans within this relative distance of the optimum count as optimal


class _Tables:
    """Arrays shared by both DP phases and the backtracking.

    Device runs are pairs ``(a, e)`` of positions in the device order (``a <= e``), sorted by
    ``e`` then ``a``.  Transitions are triples ``(e', a, e)``: the previous stage ended at
    position ``e' < a`` and this stage runs on positions ``a..e``; sorted by ``e``, ``a``,
    ``e'`` so that ``np.minimum.reduceat`` reduces each end position ``e >= 1`` at once.
    Every cost is computed by the same numpy expressions everywhere, so the phases and the
    backtracking agree bit for bit.
    """

    def __init__(self, profile: ModelProfile, topology: Topology, order: Sequence[int]) -> None:
        n_layers, n_dev = profile.num_layers, len(order)
        self.L, self.D = n_layers, n_dev
        self.C = np.asarray(profile.cumulative_compute, dtype=float)
        self.P = np.asarray(profile.cumulative_param_bytes, dtype=float)
        self.act = np.asarray(profile.activation_bytes, dtype=float)
        bw = np.asarray(topology.bandwidth, dtype=float)[np.ix_(order, order)]
        pairs = [(a, e) for e in range(n_dev) for a in range(e + 1)]
        self.pair_a = np.array([a for a, _ in pairs])
        r = np.array([e - a + 1 for a, e in pairs], dtype=float)
        ring = np.array([min((bw[a + t, a + (t + 1) % (e - a + 1)] for t in range(e - a + 1)),
                             default=math.inf) if e > a else math.inf for a, e in pairs])
        self.cS = 1.0 / r
        self.cP = np.where(r > 1, 2.0 * (r - 1) / r / ring, 0.0)
        self.w = r * (n_layers + 1) + 1  # devices, then stages, as one exact integer
        self.pair_starts = np.array([e * (e + 1) // 2 for e in range(n_dev)])
        index = {p: k for k, p in enumerate(pairs)}
        trips = [(ep, a, e) for e in range(1, n_dev) for a in range(1, e + 1) for ep in range(a)]
        self.t_pair = np.array([index[(a, e)] for _, a, e in trips], dtype=int)
        self.t_prev = np.array([ep for ep, _, _ in trips], dtype=int)
        self.t_a = np.array([a for _, a, _ in trips], dtype=int)
        self.t_bw = np.array([bw[ep, a] for ep, a, _ in trips], dtype=float)
        self.t_w = self.w[self.t_pair] if trips else np.zeros(0)
        counts = [e * (e + 1) // 2 for e in range(1, n_dev)]
        self.trip_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)

    def pair_costs(self, i: int) -> np.ndarray:
        """Compute + sync of stages ``i..j`` (rows j = i..L-1) on every run (columns)."""
        s = self.C[i + 1:] - self.C[i]
        p = self.P[i + 1:] - self.P[i]
        return s[:, None] * self.cS[None, :] + p[:, None] * self.cP[None, :]

    def trip_costs(self, i: int) -> np.ndarray:
        """Full times of stages ``i..j`` (i > 0, rows j = i..L-1) for every transition."""
        return self.pair_costs(i)[:, self.t_pair] + self.act[i - 1] / self.t_bw[None, :]


def _check_order(topology: Topology, device_order: Sequence[int] | None) -> tuple[int, ...]:
    if device_order is None:
        return topology.bandwidth_order()
    order = tuple(int(d) for d in device_order)
    if not order or len(set(order)) != len(order) or \
            any(not 0 <= d < topology.num_devices for d in order):
        raise ValueError(f"device_order must list distinct devices of the topology, got {order}")
    return order


def _best_bottleneck(t: _Tables) -> float:
    """Phase 1: ``F[j, e]`` = least bottleneck covering layers ``0..j``, last run ending at e."""
    f = np.minimum.reduceat(t.pair_costs(0), t.pair_starts, axis=1)
    for k in range(t.L - 1 if t.D > 1 else 0):
        v = np.maximum(f[k][t.t_prev][None, :], t.trip_costs(k + 1))
        np.minimum(f[k + 1:, 1:], np.minimum.reduceat(v, t.trip_starts, axis=1),
                   out=f[k + 1:, 1:])
    return float(f[-1].min())


def _fewest_devices(t: _Tables, limit: float) -> np.ndarray:
    """Phase 2: ``G[j, e]`` = least ``devices * (L+1) + stages`` with every stage <= limit."""
    g = np.minimum.reduceat(np.where(t.pair_costs(0) <= limit, t.w[None, :], np.inf),
                            t.pair_starts, axis=1)
    for k in range(t.L - 1 if t.D > 1 else 0):
        v = np.where(t.trip_costs(k + 1) <= limit, g[k][t.t_prev][None, :] + t.t_w[None, :],
                     np.inf)
        np.minimum(g[k + 1:, 1:], np.minimum.reduceat(v, t.trip_starts, axis=1),
                   out=g[k + 1:, 1:])
    return g


def _backtrack(t: _Tables, g: np.ndarray, limit: float) -> list[tuple[int, int, int, int]]:
    """Stages ``(first_layer, last_layer, a, e)`` of a plan achieving ``g``'s optimum."""
    j, e = t.L - 1, int(np.argmin(g[-1]))
    spans: list[tuple[int, int, int, int]] = []
    while True:
        target = g[j, e]
        lo = int(t.pair_starts[e])
        first = t.pair_costs(0)[j, lo:lo + e + 1]
        ok = np.flatnonzero((first <= limit) & (t.w[lo:lo + e + 1] == target))
        if ok.size:
            spans.append((0, j, int(t.pair_a[lo + ok[0]]), e))
            return spans[::-1]
        sel = slice(int(t.trip_starts[e - 1]), int(t.trip_starts[e - 1]) + e * (e + 1) // 2)
        s = t.C[j + 1] - t.C[1:j + 1]  # stages i..j for i = 1..j
        p = t.P[j + 1] - t.P[1:j + 1]
        tp = t.t_pair[sel]
        x = s[:, None] * t.cS[None, tp] + p[:, None] * t.cP[None, tp]
        cost = x + t.act[:j, None] / t.t_bw[None, sel]
        val = g[:j][:, t.t_prev[sel]] + t.t_w[None, sel]
        hit = np.flatnonzero((cost <= limit) & (val == target))
        if not hit.size:  # pragma: no cover - phase 2 guarantees a predecessor
            raise RuntimeError("pipeline DP backtracking found no predecessor")
        row, col = divmod(int(hit[0]), tp.size)
        i = row + 1
        spans.append((i, j, int(t.t_a[sel][col]), e))
        j, e = i - 1, int(t.t_prev[sel][col])


def plan_pipeline(profile: ModelProfile, topology: Topology,
                  device_order: Sequence[int] | None = None) -> PipelinePlan:
    """The bandwidth-aware planner: bandwidth-ordered devices + min-max DP with backtracking.

    Devices are ordered by :meth:`Topology.bandwidth_order` (total bandwidth, highest first,
    ties by lower id).  Stages take consecutive layer ranges and runs of consecutive positions
    of that order, in order, with unused devices allowed before and between runs.  The DP
    state is (last layer covered, position where the last run ended), as the next stage's
    ``comm_in`` depends on that device.  Phase 1 finds the least bottleneck ``T*``
    (``O(L^2 D^3)`` transitions, vectorised with numpy over the end layer and the runs; prefix
    sums give every stage's compute and parameter bytes).  Phase 2 re-runs the DP to pick,
    among the plans with every stage ``<= T* (1 + 1e-12)``, one with the **fewest devices,
    then the fewest stages**; remaining ties go, backtracking from the last layer, to the
    lowest final position, then each stage's earliest first layer, then the lowest positions.
    Stage times in the result are recomputed exactly with :func:`stage_time`.

    Args:
        profile: The model profile.
        topology: The cluster.
        device_order: Overrides the bandwidth order (a permutation of a subset of devices).

    Returns:
        The plan (method ``"bandwidth_dp"``, ``device_order`` the order searched).
    """
    order = _check_order(topology, device_order)
    t = _Tables(profile, topology, order)
    best = _best_bottleneck(t)
    limit = best + _TIE_RTOL * abs(best)
    spans = _backtrack(t, _fewest_devices(t, limit), limit)
    return make_plan(profile, topology,
                     [(i, j, order[a:e + 1]) for i, j, a, e in spans], METHOD, order)


def _splits(num_layers: int) -> Iterator[list[tuple[int, int]]]:
    """Every split of ``0..L-1`` into consecutive ranges."""
    for n_cuts in range(num_layers):
        for cuts in itertools.combinations(range(1, num_layers), n_cuts):
            edges = [0, *cuts, num_layers]
            yield [(a, b - 1) for a, b in zip(edges, edges[1:])]


def _runs(num_devices: int, count: int, start: int = 0) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every ``count`` runs ``(a, e)`` of positions, in order, gaps allowed."""
    if count == 0:
        yield ()
        return
    for a in range(start, num_devices):
        for e in range(a, num_devices):
            for rest in _runs(num_devices, count - 1, e + 1):
                yield ((a, e), *rest)


def _device_tuples(left: tuple[int, ...], count: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every ``count`` disjoint non-empty ordered device tuples drawn from ``left``."""
    if count == 0:
        yield ()
        return
    for r in range(1, len(left) - count + 2):
        for first in itertools.permutations(left, r):
            rest_left = tuple(d for d in left if d not in first)
            for rest in _device_tuples(rest_left, count - 1):
                yield (first, *rest)


def _cost(profile: ModelProfile, topology: Topology,
          spans: Sequence[tuple[int, int, tuple[int, ...]]]) -> float:
    worst, prev = 0.0, None
    for first, last, devices in spans:
        worst = max(worst, sum(stage_time(profile, topology, first, last, devices, prev)))
        prev = devices
    return worst


def _pick(profile: ModelProfile, topology: Topology, candidates: Iterator[list], method: str,
          order: tuple[int, ...]) -> PipelinePlan:
    """Least bottleneck, then fewest devices, then fewest stages (first found on ties)."""
    scored = [(_cost(profile, topology, c), c) for c in candidates]
    best = min(cost for cost, _ in scored)
    limit = best + _TIE_RTOL * abs(best)  # the DP's tie rule, so both pick the same plan
    _, spans = min(((sum(len(d) for _, _, d in c), len(c), k), c)
                   for k, (cost, c) in enumerate(scored) if cost <= limit)
    return make_plan(profile, topology, spans, method, order)


def _check_small(profile: ModelProfile, topology: Topology, max_layers: int,
                 max_devices: int) -> None:
    if profile.num_layers > max_layers:
        raise ValueError(f"profile has {profile.num_layers} layers > max_layers={max_layers}")
    if topology.num_devices > max_devices:
        raise ValueError(f"topology has {topology.num_devices} devices > "
                         f"max_devices={max_devices}")


def plan_exhaustive(profile: ModelProfile, topology: Topology, max_layers: int = 8,
                    max_devices: int = 6,
                    device_order: Sequence[int] | None = None) -> PipelinePlan:
    """Enumerates :func:`plan_pipeline`'s search space (for checks on small cases).

    Every split of the layers into consecutive ranges and every assignment of in-order runs of
    consecutive positions of the device order (gaps allowed), evaluated with the cost model.
    Ties: fewest devices, then fewest stages.

    Args:
        profile: The model profile (at most ``max_layers`` layers).
        topology: The cluster (at most ``max_devices`` devices).
        max_layers: Guard against exponential blow-up.
        max_devices: Guard against exponential blow-up.
        device_order: As in :func:`plan_pipeline` (default the bandwidth order).

    Returns:
        The best plan (method ``"exhaustive"``).
    """
    _check_small(profile, topology, max_layers, max_devices)
    order = _check_order(topology, device_order)

    def candidates() -> Iterator[list]:
        for split in _splits(profile.num_layers):
            for runs in _runs(len(order), len(split)):
                yield [(i, j, order[a:e + 1]) for (i, j), (a, e) in zip(split, runs)]

    return _pick(profile, topology, candidates(), "exhaustive", order)


def plan_bruteforce(profile: ModelProfile, topology: Topology, max_layers: int = 6,
                    max_devices: int = 4) -> PipelinePlan:
    """The true optimum of the cost model: any device subset per stage, in any ring order.

    Drops the bandwidth ordering and the consecutive-runs restriction of :func:`plan_pipeline`,
    so its bottleneck is a lower bound for every planner (tiny cases only).  Ties: fewest
    devices, then fewest stages.

    Returns:
        The best plan (method ``"bruteforce"``).
    """
    _check_small(profile, topology, max_layers, max_devices)
    devices = tuple(range(topology.num_devices))

    def candidates() -> Iterator[list]:
        for split in _splits(profile.num_layers):
            if len(split) <= len(devices):
                for tuples in _device_tuples(devices, len(split)):
                    yield [(i, j, d) for (i, j), d in zip(split, tuples)]

    return _pick(profile, topology, candidates(), "bruteforce", devices)
