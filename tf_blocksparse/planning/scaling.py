"""Alpha-beta cost model of the gradient exchange: the time of each mode's collectives.

Pure Python (no TensorFlow): the sizes and times it needs are measured elsewhere
(``launch/project_scaling.py``) and passed in.

Model (Hockney's alpha-beta, bandwidth-optimal ring algorithms, ``p`` workers, one link of
``B`` bytes/s per worker and direction, ``alpha`` seconds of latency per message)::

    ring all-reduce of n bytes            2 (p-1) alpha + 2 (p-1)/p * n / B
    ring all-gather of n bytes per worker   (p-1) alpha +   (p-1)   * n / B
    shared mode (scores s, values v)      allreduce(s) + allreduce(v)
    allgather mode (ids i, values v)      allgather(i) + allgather(v)
    dense                                 allreduce(all gradient bytes)

The collectives are priced by the project's one cost model,
:class:`~tf_blocksparse.planning.link_cost.LinkCost` (:meth:`~LinkCost.ring` derives its
lines from ``alpha`` and ``B``), and each mode's collectives by its
:func:`~tf_blocksparse.planning.link_cost.mode_seconds`, which the automatic exchange's
policy uses too.  Every collective pays its own latency term (a buffer of 0 bytes runs no
collective and costs nothing): the *fused* variant packs each buffer kind of
all variables into one collective (what :mod:`tf_blocksparse.exchange` does: two collectives
per step for the sparse modes, and what Horovod's tensor fusion does for dense), the
*per-tensor* variant runs one collective per variable and buffer kind.

The projected scaling efficiency of a mode on such a network is
:mod:`~tf_blocksparse.planning.projection`'s.

Assumptions and what the model leaves out: a flat ring over all workers (no hierarchy inside
a host; a multi-GPU host's NVLink ring hop is treated like a network hop), full-duplex links
with no contention (a non-blocking switch), no reduction compute cost, no stragglers, the
same ``alpha`` for every message and a message size independent bandwidth.  All-gather
buffers are the same size on every worker (true here: ``k`` is static per variable).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from tf_blocksparse.planning.exchange_cost import CANDIDATES
from tf_blocksparse.planning.link_cost import GroupCost, LinkCost, mode_seconds

__all__ = [
    "BITS_PER_BYTE", "MODES", "allgather_mode_time", "allgather_time", "dense_mode_time",
    "ring_allreduce_time", "shared_mode_time",
]

BITS_PER_BYTE = 8
#: Exchange modes known to :func:`exchange_cost` (the automatic exchange's candidates).
MODES = CANDIDATES


def _check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    return workers


def check_nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: float) -> float:
    if check_nonneg(name, value) <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def ring_link(workers: int, alpha_s: float, bandwidth_bytes_per_s: float) -> LinkCost:
    """The ring collectives' :class:`LinkCost` (arguments checked, named as here)."""
    p = _check_workers(workers)
    a = check_nonneg("alpha_s", alpha_s)
    b = check_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return LinkCost.ring(p, a, b)


def ring_allreduce_time(nbytes: float, workers: int, alpha_s: float,
                        bandwidth_bytes_per_s: float) -> float:
    """Time of a ring all-reduce: ``2 (p-1) alpha + 2 (p-1)/p * n / B``.

    Reduce-scatter then all-gather, each ``p-1`` steps of ``n/p`` bytes per worker.

    Args:
        nbytes: Bytes each worker contributes (the reduced buffer's size), >= 0.
        workers: ``p`` >= 1 (0 s for one worker).
        alpha_s: Latency per message in seconds, >= 0.
        bandwidth_bytes_per_s: Link bandwidth per worker and direction, > 0.

    Returns:
        Seconds.

    Raises:
        ValueError: A negative or non-finite size or latency, ``workers < 1``, or a
            bandwidth <= 0.
    """
    n = check_nonneg("nbytes", nbytes)
    return ring_link(workers, alpha_s, bandwidth_bytes_per_s).sum_seconds(n)


def allgather_time(nbytes_per_worker: float, workers: int, alpha_s: float,
                   bandwidth_bytes_per_s: float) -> float:
    """Time of a ring all-gather: ``(p-1) alpha + (p-1) * n / B``.

    Every worker receives the ``n`` bytes of each of the ``p-1`` others, so the time grows
    linearly with ``p`` (unlike the all-reduce's, which approaches ``2 n / B``).

    Args:
        nbytes_per_worker: Bytes each worker contributes, >= 0.
        workers: ``p`` >= 1.
        alpha_s: Latency per message in seconds, >= 0.
        bandwidth_bytes_per_s: Link bandwidth per worker and direction, > 0.

    Raises:
        ValueError: As :func:`ring_allreduce_time` (``nbytes_per_worker`` named).
    """
    n = check_nonneg("nbytes_per_worker", nbytes_per_worker)
    return ring_link(workers, alpha_s, bandwidth_bytes_per_s).gather_seconds(n)


def _buffers(name: str, sizes: float | Sequence[float], fused: bool) -> list[float]:
    """The collective sizes: one (the sum) if fused or a scalar, else one per entry."""
    if isinstance(sizes, (int, float)) and not isinstance(sizes, bool):
        return [check_nonneg(name, sizes)]
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(f"{name} must be a number or a sequence of numbers, got {sizes!r}")
    vals = [check_nonneg(f"{name}[{i}]", s) for i, s in enumerate(sizes)]
    if not vals:
        return []
    return [math.fsum(vals)] if fused else vals


def _mode_time(mode: str, workers: int, alpha_s: float, bandwidth_bytes_per_s: float,
               **buffers: list[float]) -> float:
    """``mode``'s seconds by :func:`mode_seconds` over the ring's :class:`LinkCost`: the
    ``i``-th buffer of every kind (``dense_bytes``, ``id_bytes``, ``score_bytes``,
    ``value_bytes``, as :class:`GroupCost` names them) is one group (one per variable, or
    one in all when fused)."""
    link = ring_link(workers, alpha_s, bandwidth_bytes_per_s)
    groups = itertools.zip_longest(*buffers.values(), fillvalue=0.0)
    return math.fsum(mode_seconds(link, GroupCost(**{"dense_bytes": 0.0,
                                                     **dict(zip(buffers, sizes))}), mode)
                     for sizes in groups)


def dense_mode_time(tensor_bytes: float | Sequence[float], workers: int, alpha_s: float,
                    bandwidth_bytes_per_s: float, fused: bool = True) -> float:
    """Dense exchange: ring all-reduce of the gradients, fused or one per tensor.

    Args:
        tensor_bytes: Gradient bytes per variable (or their total).
        workers: ``p`` >= 1.
        alpha_s: Latency per message, >= 0.
        bandwidth_bytes_per_s: > 0.
        fused: One all-reduce of all tensors (else one per tensor, each with its latency).

    Raises:
        ValueError: Bad sizes, ``workers``, ``alpha_s`` or bandwidth.
    """
    return _mode_time("dense", workers, alpha_s, bandwidth_bytes_per_s,
                      dense_bytes=_buffers("tensor_bytes", tensor_bytes, fused))


def shared_mode_time(score_bytes: float | Sequence[float], value_bytes: float | Sequence[float],
                     workers: int, alpha_s: float, bandwidth_bytes_per_s: float,
                     fused: bool = True) -> float:
    """Shared mode: all-reduce of the block scores, then of the selected blocks' values.

    Both sizes are flat in ``p`` (every worker sends the same blocks).

    Args:
        score_bytes: Score bytes per variable (4 per block), or their total.
        value_bytes: Selected values' bytes per variable, or their total.
        workers: ``p`` >= 1.
        alpha_s: Latency per message, >= 0.
        bandwidth_bytes_per_s: > 0.
        fused: Two collectives in all (else two per variable).

    Raises:
        ValueError: Bad sizes, ``workers``, ``alpha_s`` or bandwidth.
    """
    return _mode_time("shared", workers, alpha_s, bandwidth_bytes_per_s,
                      score_bytes=_buffers("score_bytes", score_bytes, fused),
                      value_bytes=_buffers("value_bytes", value_bytes, fused))


def allgather_mode_time(id_bytes: float | Sequence[float], value_bytes: float | Sequence[float],
                        workers: int, alpha_s: float, bandwidth_bytes_per_s: float,
                        fused: bool = True) -> float:
    """Allgather mode: all-gather of every worker's block ids, then of its blocks' values.

    Args:
        id_bytes: Block-id bytes per variable (4 per kept block; the fused id buffer also
            carries a 4-byte non-finite flag: include it), or their total.
        value_bytes: Kept values' bytes per variable, or their total.
        workers: ``p`` >= 1.
        alpha_s: Latency per message, >= 0.
        bandwidth_bytes_per_s: > 0.
        fused: Two collectives in all (else two per variable).

    Raises:
        ValueError: Bad sizes, ``workers``, ``alpha_s`` or bandwidth.
    """
    return _mode_time("allgather", workers, alpha_s, bandwidth_bytes_per_s,
                      id_bytes=_buffers("id_bytes", id_bytes, fused),
                      value_bytes=_buffers("value_bytes", value_bytes, fused))
