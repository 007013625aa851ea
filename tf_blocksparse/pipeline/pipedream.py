"""PipeDream's hierarchical partitioning dynamic program, as a baseline.

Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019,
Sec. 3.1.  The cluster is a hierarchy of levels: level 1's components (e.g. servers) hold
``m_1`` workers (devices) linked at bandwidth ``B_1``, level 2's components hold ``m_2``
level-1 components linked at ``B_2``, and so on.  The planner solves level 1 inside one
component, then at level ``k`` treats each level-``(k-1)`` component as one worker whose time
for layers ``i..j`` is the level below's optimum ``A^{k-1}(i..j, m_{k-1})``.  Its result is
placed on concrete devices and evaluated with the shared cost model of
:mod:`~tf_blocksparse.pipeline.plan`, like every planner here.  Pure Python + numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .plan import PipelinePlan, make_plan
from .profile import ModelProfile
from .topology import Topology

__all__ = ["pipedream_levels", "plan_pipedream"]

Level = tuple[int, float]
_Tables = tuple[np.ndarray, np.ndarray, np.ndarray]


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


def _check_levels(levels: Sequence[Level], num_devices: int) -> tuple[Level, ...]:
    try:
        pairs = [tuple(x) for x in levels]
    except TypeError as err:
        raise ValueError("levels must be a sequence of (components, bandwidth) pairs") from err
    if not pairs or any(len(x) != 2 for x in pairs):
        raise ValueError(f"levels must be a non-empty sequence of (components, bandwidth) "
                         f"pairs, got {levels!r}")
    out, total = [], 1
    for k, (m, bw) in enumerate(pairs):
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"levels[{k}]: components must be an int >= 1, got {m!r}")
        if isinstance(bw, bool) or not isinstance(bw, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(bw) and bw > 0):
            raise ValueError(f"levels[{k}]: bandwidth must be finite and > 0, got {bw!r}")
        out.append((int(m), float(bw)))
        total *= int(m)
    if total > num_devices:
        raise ValueError(f"levels need {total} devices, the topology has {num_devices}")
    return tuple(out)


def pipedream_levels(topology: Topology, level_bandwidth: str | float | None = None
                     ) -> tuple[tuple[int, ...], tuple[Level, ...]]:
    """The device order and levels :func:`plan_pipedream` derives from a topology.

    With ``level_bandwidth=None``, a topology that :meth:`Topology.hierarchy` recognises as
    two or more uniform levels (nodes are the groups of devices whose mutual bandwidth is the
    largest link bandwidth; see there) gives that hierarchy and its device order.  Otherwise
    (a flat cluster: homogeneous, random links, ...) or when ``level_bandwidth`` is given, the
    one-level form: every device in id order on one level of bandwidth ``level_bandwidth``
    (``"mean"`` link bandwidth by default, ``"min"`` the slowest link, or bytes/s).

    Returns:
        ``(device_order, levels)`` with ``levels[k-1] = (m_k, B_k)``, innermost first.
    """
    if level_bandwidth is None:
        found = topology.hierarchy()
        if found is not None and len(found[1]) > 1:
            return found
        level_bandwidth = "mean"
    order = tuple(range(topology.num_devices))
    return order, ((topology.num_devices, _level_bandwidth(topology, level_bandwidth)),)


def _solve_level(base: np.ndarray, cum_params: np.ndarray, activation: np.ndarray,
                 workers: int, bw: float, rows: int) -> _Tables:
    """One level ``k`` of the recurrence, for the first layers ``i = 0..rows-1``.

    Args:
        base: [L, L] ``A^{k-1}(i..j)``, the time of layers ``i..j`` on one worker of this
            level (inf for ``j < i``).
        cum_params: [L + 1] cumulative parameter bytes.
        activation: [L] output activation bytes of every layer.
        workers: ``m_k``.
        bw: ``B_k`` in bytes/s.
        rows: Number of first layers ``i`` solved.

    Returns:
        ``best`` [rows, L, m_k + 1]: ``A^k(i..j, m)`` using at most ``m`` workers; ``used``
        [rows, L, m_k + 1]: the workers that optimum uses; ``choice`` [rows, L, m_k + 1, 2]:
        for exactly ``m`` workers, the split ``s`` (``i - 1`` for one stage) and the last
        stage's workers ``m'``.
    """
    n = base.shape[0]
    reps = np.arange(1, workers + 1, dtype=float)
    par = cum_params[None, 1:] - cum_params[:-1, None]
    stage = base[:, :, None] / reps + 4.0 * (reps - 1) * par[:, :, None] / (reps * bw)
    comm = 2.0 * activation / bw
    best = np.full((rows, n, workers + 1), math.inf)
    used = np.zeros((rows, n, workers + 1), dtype=int)
    choice = np.zeros((rows, n, workers + 1, 2), dtype=int)
    r = np.arange(rows)
    for j in range(n):
        for m in range(1, workers + 1):
            exact, split, last = stage[:rows, j, m - 1], r - 1, np.full(rows, m)
            if j > 0 and m > 1:
                prev = best[:, :j, m - 1:0:-1]  # [rows, j, m-1]: A(i..s, m - m'), m' = 1..m-1
                tail = stage[1:j + 1, j, :m - 1]  # [j, m-1]: T(s+1..j, m')
                cand = np.maximum(np.maximum(prev, comm[None, :j, None]), tail[None])
                flat = cand.reshape(rows, -1)
                k = flat.argmin(axis=1)
                val = flat[r, k]
                better = val < exact
                exact = np.where(better, val, exact)
                split = np.where(better, k // (m - 1), split)
                last = np.where(better, k % (m - 1) + 1, last)
            choice[:, j, m, 0], choice[:, j, m, 1] = split, last
            keep = exact < best[:, j, m - 1]
            best[:, j, m] = np.where(keep, exact, best[:, j, m - 1])
            used[:, j, m] = np.where(keep, m, used[:, j, m - 1])
    return best, used, choice


def _expand(tables: list[_Tables], levels: Sequence[Level], k: int, i: int,
            j: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Stages of layers ``i..j`` inside one level-``k`` component, devices as offsets.

    A stage on ``m'`` level-``(k-1)`` components runs the level below's plan of its layers
    in each of them; its sub-stages gather the same devices of every replica, replica by
    replica (the ring order).  Stages take the next components in order.
    """
    if k == 0:
        return [(i, j, (0,))]
    _, used, choice = tables[k - 1]
    stages, m = [], levels[k - 1][0]
    while True:
        m = int(used[i, j, m])
        s, last = (int(x) for x in choice[i, j, m])
        stages.append((s + 1, j, last))
        if s < i:
            break
        j, m = s, m - last
    size = math.prod(w for w, _ in levels[:k - 1])  # devices of a level-(k-1) component
    out, nxt = [], 0
    for first, last_layer, count in stages[::-1]:
        for a, b, offs in _expand(tables, levels, k - 1, first, last_layer):
            out.append((a, b, tuple((nxt + c) * size + o for c in range(count) for o in offs)))
        nxt += count
    return out


def plan_pipedream(profile: ModelProfile, topology: Topology,
                   level_bandwidth: str | float | None = None,
                   levels: Sequence[Level] | None = None) -> PipelinePlan:
    """PipeDream's hierarchical partitioning dynamic program, placed and evaluated.

    At level ``k`` (bandwidth ``B_k``, ``m_k`` workers per component), with ``a_s`` layer
    ``s``'s output activation and ``|w_{i..j}|`` the parameter bytes of layers ``i..j``:

    ``A^k(i..j, m) = min( T^k(i..j, m), min_{i<=s<j} min_{1<=m'<m} max(A^k(i..s, m-m'),
    2 a_s / B_k, T^k(s+1..j, m')) )``

    ``T^k(i..j, m) = A^{k-1}(i..j, m_{k-1}) / m + 4 (m-1) |w_{i..j}| / (m B_k)``

    with ``A^0(i..j) = sum(compute[i..j])`` (one device).  ``2 a_s / B_k`` sends an
    activation forward and its gradient back.  **``T^k`` is the sum form**: the stage's
    compute and its data-parallel weight synchronisation (``4 (m-1)/m |w|`` bytes) do not
    overlap; the paper's text combines the two terms with a ``max`` (perfect overlap), and its
    released optimizer additionally divides the synchronisation by ``m`` (and, in its
    one-stage term, by ``m_{k-1}``).  As in the optimizer's "use fewer machines" option, ``A``
    may leave workers idle (``A^k(i..j, m) <= A^k(i..j, m-1)``); ties prefer fewer workers,
    then a single stage, then the earliest split and the fewest workers in the last stage.
    Levels below the top are solved for every first layer ``i``, the top level for ``i = 0``.

    Placement: a stage on ``m'`` components runs, in each of them, the level below's plan of
    its layers; each finest sub-stage becomes one stage of the result whose devices are that
    sub-stage's devices in every replica component, replica by replica (its ring order).
    Stages take the next components in order.  With one level this is the flat form: stage
    ``k`` gets the next ``m_k`` device ids in id order.

    Args:
        profile: The model profile.
        topology: The cluster.
        level_bandwidth: Asks for the one-level form with this bandwidth: ``"mean"`` or
            ``"min"`` link bandwidth, or bytes/s.  ``None`` (default): the levels of
            :func:`pipedream_levels` (the topology's hierarchy when it has two or more
            uniform levels, e.g. :meth:`Topology.two_level`; else one level at the mean).
        levels: Explicit ``(m_k, B_k)`` pairs, innermost first, over the devices in id order
            (level-1 component ``c`` holds devices ``c m_1 .. (c+1) m_1 - 1``, and so on);
            ``prod(m_k)`` may be less than the number of devices (the rest stay unused).
            ``levels=[(D, B)]`` is the one-level form.  Exclusive with ``level_bandwidth``.

    Returns:
        The plan evaluated with the shared cost model (method ``"pipedream"``,
        ``device_order`` the order the components were laid out in).

    Raises:
        ValueError: Bad ``level_bandwidth`` or ``levels``, or both given.
    """
    if levels is not None:
        if level_bandwidth is not None:
            raise ValueError("give at most one of level_bandwidth and levels")
        lv = _check_levels(levels, topology.num_devices)
        order = tuple(range(topology.num_devices))
    else:
        order, lv = pipedream_levels(topology, level_bandwidth)
    n_layers = profile.num_layers
    c = np.asarray(profile.cumulative_compute)
    w = np.asarray(profile.cumulative_param_bytes)
    act = np.asarray(profile.activation_bytes, dtype=float)
    idx = np.arange(n_layers)
    base = np.where(idx[None, :] >= idx[:, None], c[None, 1:] - c[:-1, None], math.inf)
    tables: list[_Tables] = []
    for k, (workers, bw) in enumerate(lv):
        top = k == len(lv) - 1
        tables.append(_solve_level(base, w, act, workers, bw, 1 if top else n_layers))
        if not top:
            base = tables[-1][0][:, :, workers]
    spans = [(i, j, tuple(order[o] for o in offs))
             for i, j, offs in _expand(tables, lv, len(lv), 0, n_layers - 1)]
    return make_plan(profile, topology, spans, "pipedream", order)
