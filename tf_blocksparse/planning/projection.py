"""Projected scaling efficiency of an exchange mode on a flat network (pure Python).

Scaling efficiency of one step is ``compute / (compute + extra + exposed)``: the time of one
worker computing alone over the time of one worker in the cluster.  ``extra`` is work on the
critical path that the single worker does not do (block selection and packing, measured);
``exposed = max(0, comm - overlap * compute)`` is the communication not hidden behind
computation.  ``overlap`` is the fraction of the step's computation that communication can
run concurrently with.  Wait-free back-propagation (Horovod, DDP, our fusion groups) starts
exchanging the last layers' gradients during the backward pass, which is about two thirds of
forward + backward, so ``overlap = 2/3`` is an optimistic bound; ``overlap = 0`` (exchange
after the whole backward pass, as a single fused buffer does) is the pessimistic one.

The exchange times come from the alpha-beta model of :mod:`~tf_blocksparse.planning.scaling`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tf_blocksparse.planning.link_cost import LinkCost
from tf_blocksparse.planning.scaling import (
    BITS_PER_BYTE,
    MODES,
    allgather_mode_time,
    check_nonneg,
    check_positive,
    dense_mode_time,
    ring_link,
    shared_mode_time,
)

__all__ = ["ExchangeCost", "NetworkModel", "exchange_cost", "scaling_efficiency"]


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
    c = check_positive("compute_s", compute_s)
    m = check_nonneg("comm_s", comm_s)
    e = check_nonneg("extra_s", extra_s)
    o = check_nonneg("overlap", overlap)
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
        check_positive("bandwidth_gbit", self.bandwidth_gbit)
        check_nonneg("alpha_s", self.alpha_s)

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
        return ring_link(workers, self.alpha_s, self.bandwidth_bytes_per_s)


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
        extra = check_nonneg("select_s", select_s)
    elif mode == "shared":
        comm = shared_mode_time(score_bytes, value_bytes, workers, a, b, fused)
        extra = check_nonneg("select_s", select_s)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return ExchangeCost(mode, workers, comm, extra,
                        scaling_efficiency(compute_s, comm, 0.0, extra),
                        scaling_efficiency(compute_s, comm, overlap, extra))
