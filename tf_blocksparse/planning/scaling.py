"""Alpha-beta cost model of the gradient exchange, and projected scaling efficiency.

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

Scaling efficiency of one step is ``compute / (compute + extra + exposed)``: the time of one
worker computing alone over the time of one worker in the cluster.  ``extra`` is work on the
critical path that the single worker does not do (block selection and packing, measured);
``exposed = max(0, comm - overlap * compute)`` is the communication not hidden behind
computation.  ``overlap`` is the fraction of the step's computation that communication can
run concurrently with.  Wait-free back-propagation (Horovod, DDP, our fusion groups) starts
exchanging the last layers' gradients during the backward pass, which is about two thirds of
forward + backward, so ``overlap = 2/3`` is an optimistic bound; ``overlap = 0`` (exchange
after the whole backward pass, as a single fused buffer does) is the pessimistic one.

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
from dataclasses import dataclass

from tf_blocksparse.planning.exchange_cost import CANDIDATES
from tf_blocksparse.planning.link_cost import GroupCost, LinkCost, mode_seconds

__all__ = [
    "BITS_PER_BYTE", "MODES", "ExchangeCost", "NetworkModel", "allgather_mode_time",
    "allgather_time", "dense_mode_time", "exchange_cost", "ring_allreduce_time",
    "scaling_efficiency", "shared_mode_time",
]

BITS_PER_BYTE = 8
#: Exchange modes known to :func:`exchange_cost` (the automatic exchange's candidates).
MODES = CANDIDATES


def _check_workers(workers: int) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    return workers


def _check_nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_positive(name: str, value: float) -> float:
    if _check_nonneg(name, value) <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def _link(workers: int, alpha_s: float, bandwidth_bytes_per_s: float) -> LinkCost:
    """The ring collectives' :class:`LinkCost` (arguments checked, named as here)."""
    p = _check_workers(workers)
    a = _check_nonneg("alpha_s", alpha_s)
    b = _check_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
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
    n = _check_nonneg("nbytes", nbytes)
    return _link(workers, alpha_s, bandwidth_bytes_per_s).sum_seconds(n)


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
    n = _check_nonneg("nbytes_per_worker", nbytes_per_worker)
    return _link(workers, alpha_s, bandwidth_bytes_per_s).gather_seconds(n)


def _buffers(name: str, sizes: float | Sequence[float], fused: bool) -> list[float]:
    """The collective sizes: one (the sum) if fused or a scalar, else one per entry."""
    if isinstance(sizes, (int, float)) and not isinstance(sizes, bool):
        return [_check_nonneg(name, sizes)]
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(f"{name} must be a number or a sequence of numbers, got {sizes!r}")
    vals = [_check_nonneg(f"{name}[{i}]", s) for i, s in enumerate(sizes)]
    if not vals:
        return []
    return [math.fsum(vals)] if fused else vals


def _mode_time(mode: str, workers: int, alpha_s: float, bandwidth_bytes_per_s: float,
               **buffers: list[float]) -> float:
    """``mode``'s seconds by :func:`mode_seconds` over the ring's :class:`LinkCost`: the
    ``i``-th buffer of every kind (``dense_bytes``, ``id_bytes``, ``score_bytes``,
    ``value_bytes``, as :class:`GroupCost` names them) is one group (one per variable, or
    one in all when fused)."""
    link = _link(workers, alpha_s, bandwidth_bytes_per_s)
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


def scaling_efficiency(compute_s: float, comm_s: float, overlap: float = 0.0,
                       extra_s: float = 0.0) -> float:
    """``compute / (compute + extra + max(0, comm - overlap * compute))``.

    Args:
        compute_s: One worker's forward + backward time per step, > 0.
        comm_s: The exchange's time per step, >= 0.
        overlap: Fraction of ``compute_s`` that communication can hide behind, in [0, 1]
            (about 2/3 at most with wait-free back-propagation: the backward pass).
        extra_s: Critical-path work only the distributed step does (selection), >= 0.

    Returns:
        The efficiency in (0, 1].

    Raises:
        ValueError: ``compute_s <= 0``, negative ``comm_s`` / ``extra_s``, or ``overlap``
            outside [0, 1].
    """
    c = _check_positive("compute_s", compute_s)
    m = _check_nonneg("comm_s", comm_s)
    e = _check_nonneg("extra_s", extra_s)
    o = _check_nonneg("overlap", overlap)
    if o > 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    return c / (c + e + max(0.0, m - o * c))


@dataclass(frozen=True)
class NetworkModel:
    """A flat network: every worker has one full-duplex link.

    Attributes:
        bandwidth_gbit: Link rate per direction in Gbit/s (10**9 bit/s), > 0.
        alpha_s: Latency per message (software + wire), >= 0.
    """

    bandwidth_gbit: float
    alpha_s: float = 25e-6

    def __post_init__(self) -> None:
        _check_positive("bandwidth_gbit", self.bandwidth_gbit)
        _check_nonneg("alpha_s", self.alpha_s)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The rate in bytes per second."""
        return self.bandwidth_gbit * 1e9 / BITS_PER_BYTE

    def link(self, workers: int) -> LinkCost:
        """The ring collectives among ``workers`` on this network, as the cost model's
        :class:`LinkCost` (:meth:`LinkCost.ring`).

        Raises:
          ValueError: ``workers`` not an int >= 1.
        """
        return _link(workers, self.alpha_s, self.bandwidth_bytes_per_s)


@dataclass(frozen=True)
class ExchangeCost:
    """One mode's cost and efficiency at one cluster size.

    Attributes:
        mode: ``"dense"``, ``"allgather"`` or ``"shared"``.
        workers: ``p``.
        comm_s: Exchange time per step.
        extra_s: Selection time per step (0 for dense).
        efficiency: :func:`scaling_efficiency` with ``overlap = 0``.
        efficiency_overlap: The same with the given ``overlap``.
    """

    mode: str
    workers: int
    comm_s: float
    extra_s: float
    efficiency: float
    efficiency_overlap: float


def exchange_cost(mode: str, workers: int, network: NetworkModel, compute_s: float, *,
                  dense_bytes: float | Sequence[float] = 0.0,
                  id_bytes: float | Sequence[float] = 0.0,
                  score_bytes: float | Sequence[float] = 0.0,
                  value_bytes: float | Sequence[float] = 0.0,
                  select_s: float = 0.0, overlap: float = 2 / 3,
                  fused: bool = True) -> ExchangeCost:
    """Exchange time and efficiency of one mode (the sizes it does not use are ignored).

    Args:
        mode: ``"dense"`` (uses ``dense_bytes``), ``"allgather"`` (``id_bytes``,
            ``value_bytes``) or ``"shared"`` (``score_bytes``, ``value_bytes``).
        workers: ``p`` >= 1.
        network: Link rate and latency.
        compute_s: Forward + backward time per step, > 0.
        dense_bytes: Gradient bytes per variable (or total).
        id_bytes: Allgather id bytes per variable (or total).
        score_bytes: Shared-mode score bytes per variable (or total).
        value_bytes: Kept values' bytes per variable (or total).
        select_s: Selection time per step (charged to the sparse modes only), >= 0.
        overlap: The optimistic overlap for ``efficiency_overlap``, in [0, 1].
        fused: Fused buffers (else per tensor).

    Raises:
        ValueError: An unknown ``mode`` or any bad number.
    """
    a, b = network.alpha_s, network.bandwidth_bytes_per_s
    if mode == "dense":
        comm, extra = dense_mode_time(dense_bytes, workers, a, b, fused), 0.0
    elif mode == "allgather":
        comm = allgather_mode_time(id_bytes, value_bytes, workers, a, b, fused)
        extra = _check_nonneg("select_s", select_s)
    elif mode == "shared":
        comm = shared_mode_time(score_bytes, value_bytes, workers, a, b, fused)
        extra = _check_nonneg("select_s", select_s)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return ExchangeCost(mode, workers, comm, extra,
                        scaling_efficiency(compute_s, comm, 0.0, extra),
                        scaling_efficiency(compute_s, comm, overlap, extra))
