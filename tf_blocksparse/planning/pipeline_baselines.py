"""Baselines for the pipeline planner (SPEC S3): PipeDream's partitioner and an oblivious split.

Each baseline decides with its own model, then its result is placed on concrete devices and
**evaluated with the same cost model** (:mod:`.pipeline_cost`) as :func:`plan_pipeline`, so
:func:`compare_pipeline_plans` compares like with like.  Pure Python + numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .pipeline import plan_pipeline
from .pipeline_cost import PipelinePlan, make_plan
from .profile import ModelProfile
from .topology import Topology

__all__ = ["compare_pipeline_plans", "plan_oblivious", "plan_pipedream"]


def _level_bandwidth(topology: Topology, level_bandwidth: str | float) -> float:
    if isinstance(level_bandwidth, str):
        if level_bandwidth not in ("mean", "min"):
            raise ValueError(f"level_bandwidth must be 'mean', 'min' or a number, got "
                             f"{level_bandwidth!r}")
        bw = topology.mean_bandwidth() if level_bandwidth == "mean" else \
            topology.min_bandwidth()
        return bw if math.isfinite(bw) else 1.0  # one device: no link is ever used
    bw = float(level_bandwidth)
    if not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"level_bandwidth must be finite and > 0, got {level_bandwidth}")
    return bw


def plan_pipedream(profile: ModelProfile, topology: Topology,
                   level_bandwidth: str | float = "mean") -> PipelinePlan:
    """PipeDream's partitioning dynamic program, on one level of the hierarchy.

    Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019,
    Sec. 3.1: with ``A(j, m)`` the slowest stage of the best pipeline of layers ``0..j`` on
    ``m`` workers of a level with bandwidth ``B``,

    ``A(j, m) = min( T(0..j, m), min_{s<j} min_{1<=m'<m} max(A(s, m-m'), 2 a_s / B,
    T(s+1..j, m')) )``

    where ``a_s`` is layer ``s``'s output activation (``2 a_s / B`` sends it forward and its
    gradient back) and a stage replicated ``m'`` ways takes
    ``T(i..j, m') = compute(i..j) / m' + 4 (m'-1) |w(i..j)| / (m' B)``, the data-parallel weight
    synchronisation term of PipeDream's model (as in its released optimizer; the SOSP text
    writes the synchronisation inside a ``max`` with the compute).  As in the optimizer's
    "use fewer machines" option, ``A`` may leave workers idle (``A(j, m) <= A(j, m-1)``).

    PipeDream sees the cluster only per level: here the topology is one level whose bandwidth
    ``B`` is the **mean** link bandwidth (``level_bandwidth="min"`` takes the slowest link, or
    pass a number).  It does not order devices by bandwidth: stage ``k`` gets the next ``m_k``
    device ids in id order.  Ties prefer fewer workers, then fewer stages.

    Args:
        profile: The model profile.
        topology: The cluster.
        level_bandwidth: ``"mean"``, ``"min"`` or bytes/s.

    Returns:
        The plan evaluated with the shared cost model (method ``"pipedream"``).
    """
    bw = _level_bandwidth(topology, level_bandwidth)
    n_layers, n_dev = profile.num_layers, topology.num_devices
    c = np.asarray(profile.cumulative_compute)
    w = np.asarray(profile.cumulative_param_bytes)
    comm = 2.0 * np.asarray(profile.activation_bytes, dtype=float) / bw
    reps = np.arange(1, n_dev + 1, dtype=float)

    def stage(i: np.ndarray | int, j: int) -> np.ndarray:
        """``T(i..j, m')`` for rows ``i`` and columns ``m' = 1..D``."""
        comp = np.atleast_1d(c[j + 1] - c[i])[:, None]
        par = np.atleast_1d(w[j + 1] - w[i])[:, None]
        return comp / reps + 4.0 * (reps - 1) * par / (reps * bw)

    best = np.full((n_layers, n_dev + 1), math.inf)  # best[j, m]: at most m workers
    used = np.zeros((n_layers, n_dev + 1), dtype=int)  # workers the best uses
    choice = np.full((n_layers, n_dev + 1, 2), -1, dtype=int)  # (s, m') for exactly m
    for j in range(n_layers):
        whole = stage(0, j)[0]
        tail = stage(np.arange(1, j + 1), j)  # rows s = 0..j-1: stage s+1..j
        for m in range(1, n_dev + 1):
            exact, pick = whole[m - 1], (-1, m)
            if j > 0 and m > 1:
                prev = best[:j, m - 1:0:-1]  # columns m' = 1..m-1: A(s, m - m')
                cand = np.maximum(np.maximum(prev, comm[:j, None]), tail[:, :m - 1])
                k = int(np.argmin(cand))
                if cand.flat[k] < exact:
                    exact, pick = float(cand.flat[k]), (k // (m - 1), k % (m - 1) + 1)
            choice[j, m] = pick
            if exact < best[j, m - 1]:
                best[j, m], used[j, m] = exact, m
            else:
                best[j, m], used[j, m] = best[j, m - 1], used[j, m - 1]
    counts, ranges = [], []
    j, m = n_layers - 1, n_dev
    while True:
        m = used[j, m]
        s, mp = choice[j, m]
        ranges.append((s + 1, j))
        counts.append(mp)
        if s < 0:
            break
        j, m = s, m - mp
    spans, nxt = [], 0
    for (i, j), k in zip(ranges[::-1], counts[::-1]):
        spans.append((i, j, tuple(range(nxt, nxt + k))))
        nxt += k
    return make_plan(profile, topology, spans, "pipedream", tuple(range(n_dev)))


def plan_oblivious(profile: ModelProfile, topology: Topology,
                   num_stages: int | None = None) -> PipelinePlan:
    """Bandwidth-oblivious balanced split: one device per stage, in id order.

    The layers are split into ``num_stages`` consecutive non-empty ranges minimising the
    largest stage compute (an exact linear-partition DP; communication and bandwidth ignored);
    stage ``k`` runs on device ``k``.

    Args:
        profile: The model profile.
        topology: The cluster.
        num_stages: Number of stages (default and maximum ``min(L, D)``).

    Returns:
        The plan evaluated with the shared cost model (method ``"oblivious"``).
    """
    n_layers = profile.num_layers
    top = min(n_layers, topology.num_devices)
    n = top if num_stages is None else num_stages
    if isinstance(n, bool) or int(n) != n or not 1 <= n <= top:
        raise ValueError(f"num_stages must be an int in [1, {top}], got {num_stages!r}")
    n = int(n)
    c = np.asarray(profile.cumulative_compute)
    # f[k, j]: least largest compute splitting layers 0..j into k+1 ranges; cut[k, j]: start of
    # the last range.
    f = np.full((n, n_layers), math.inf)
    cut = np.zeros((n, n_layers), dtype=int)
    f[0] = c[1:] - c[0]
    for k in range(1, n):
        for j in range(k, n_layers):
            i = np.arange(k, j + 1)  # the last range is i..j
            v = np.maximum(f[k - 1, i - 1], c[j + 1] - c[i])
            best = int(np.argmin(v))
            f[k, j], cut[k, j] = v[best], i[best]
    spans, j = [], n_layers - 1
    for k in range(n - 1, -1, -1):
        i = int(cut[k, j]) if k else 0
        spans.append((i, j, (k,)))
        j = i - 1
    return make_plan(profile, topology, spans[::-1], "oblivious",
                     tuple(range(topology.num_devices)))


def compare_pipeline_plans(profile: ModelProfile, topology: Topology,
                           plans: Sequence[PipelinePlan] | None = None) -> list[dict]:
    """Summarises :func:`plan_pipeline`, :func:`plan_pipedream` and :func:`plan_oblivious`.

    Args:
        profile: The model profile.
        topology: The cluster.
        plans: Plans to summarise instead of the three defaults.

    Returns:
        One dict per plan: ``method``, ``stages`` (count), ``devices_used`` (count),
        ``devices`` (the ids, stage by stage), ``bottleneck_s`` and ``throughput``
        (``1 / bottleneck_s``, micro-batches per second).
    """
    if plans is None:
        plans = [plan_pipeline(profile, topology), plan_pipedream(profile, topology),
                 plan_oblivious(profile, topology)]
    return [{"method": p.method, "stages": p.num_stages, "devices_used": len(p.devices_used),
             "devices": list(p.devices_used), "bottleneck_s": p.bottleneck_s,
             "throughput": p.throughput} for p in plans]
