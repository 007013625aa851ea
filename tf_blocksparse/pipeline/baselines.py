"""Baselines for the pipeline planner: an oblivious split, and all planners side by side.

PipeDream's hierarchical dynamic program lives in
:mod:`~tf_blocksparse.pipeline.pipedream`.  Each baseline decides with its own model,
then its result is placed on concrete devices and **evaluated with the same cost model**
(:mod:`~tf_blocksparse.pipeline.plan`) as
:func:`plan_pipeline`, so :func:`compare_pipeline_plans` compares like with like.  Pure
Python + numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .partition import plan_pipeline
from .pipedream import plan_pipedream
from .plan import PipelinePlan, make_plan
from .profile import ModelProfile
from .topology import Topology

__all__ = ["compare_pipeline_plans", "plan_oblivious"]


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
