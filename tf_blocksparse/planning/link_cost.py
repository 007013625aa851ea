"""The one cost model of the exchange modes, and their names (pure Python, no TensorFlow).

Every mode name of the project is defined here, once: :data:`EXCHANGES` (and its sparse
part, :data:`SPARSE_EXCHANGES`); :mod:`tf_blocksparse.options`, the automatic exchange's
policy (:mod:`~tf_blocksparse.planning.exchange_cost`) and the scaling projection
(:mod:`~tf_blocksparse.planning.scaling`) import them.

A collective costs ``latency + bytes * seconds_per_byte`` (:class:`LinkCost`), an all-reduce
and an all-gather each with their own line: fitted to collectives timed on the running
cluster (:meth:`LinkCost.fit`, the automatic exchange) or derived from a network's latency
and bandwidth (:meth:`LinkCost.ring`, the scaling projection).  An empty buffer runs no
collective and costs nothing.  One step of a fusion group's exchange (:class:`GroupCost`:
its byte sizes and compression time) costs, per mode (:func:`mode_seconds`)::

    dense      sum(D_g)
    allgather  c_g + sum(W_g) + gather(I_g) + gather(V_g)
    shared     c_g + sum(W_g) + sum(S_g) + sum(V_g)

with ``D_g`` the group's dense bytes, ``W_g`` the bytes of its variables sent whole,
``I_g``/``V_g``/``S_g`` one replica's block ids, block values and block scores, and ``c_g``
the compression time (accumulate, score, select, residual).  Adjacent groups of one mode are
exchanged together (:func:`merge_runs`, :func:`exchange_seconds`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["EXCHANGES", "SPARSE_EXCHANGES", "GroupCost", "LinkCost", "exchange_seconds",
           "merge_runs", "mode_seconds"]

T = TypeVar("T")

#: Every exchange mode: every replica its own top-k blocks, blocks agreed from summed scores,
#: or a plain dense all-reduce (see :mod:`tf_blocksparse.exchange`).
EXCHANGES = ("allgather", "shared", "dense")
#: The block-sparse ones.
SPARSE_EXCHANGES = EXCHANGES[:2]


def number(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as a float, if a finite number >= 0 (> 0 if ``positive``).

    Raises:
      ValueError: Naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0 or (positive and value <= 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"`{name}` must be a finite number {bound}, got {value!r}")
    return float(value)


def count(name: str, value: Any, minimum: int) -> int:
    """``value``, if an int >= ``minimum``.

    Raises:
      ValueError: Naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LinkCost:
    """Measured collective times as ``latency + bytes * seconds_per_byte``.

    Attributes:
      sum_latency_s: Fixed cost of one all-reduce (seconds).
      sum_s_per_byte: Its cost per byte of the reduced buffer.
      gather_latency_s: Fixed cost of one all-gather.
      gather_s_per_byte: Its cost per byte that *one* replica contributes.
    """

    sum_latency_s: float
    sum_s_per_byte: float
    gather_latency_s: float
    gather_s_per_byte: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            number(f.name, getattr(self, f.name))

    @classmethod
    def fit(cls, sizes: Sequence[int], sum_s: Sequence[float], gather_s: Sequence[float],
            gather_sizes: Sequence[int] | None = None) -> LinkCost:
        """Least-squares lines through the probes (``sizes[i]`` bytes took ``sum_s[i]``
        seconds, ``gather_sizes[i]`` (default ``sizes``) took ``gather_s[i]``); negative
        intercepts and slopes are clamped to 0.

        Raises:
          ValueError: Fewer than two distinct sizes, or mismatched lengths.
        """
        gather_sizes = sizes if gather_sizes is None else gather_sizes
        for name, xs, ys in (("sizes", sizes, sum_s), ("gather_sizes", gather_sizes, gather_s)):
            if len(xs) != len(ys) or len(set(xs)) < 2:
                raise ValueError(f"`{name}` needs at least two distinct sizes and one time "
                                 f"per size; got {list(xs)!r} and {len(ys)} times")
        return cls(*_line(sizes, sum_s), *_line(gather_sizes, gather_s))

    @classmethod
    def ring(cls, workers: int, alpha_s: float, bandwidth_bytes_per_s: float) -> LinkCost:
        """Hockney's alpha-beta model of bandwidth-optimal ring collectives among ``workers``
        (one full-duplex link of ``bandwidth_bytes_per_s`` per worker and direction,
        ``alpha_s`` seconds per message): an all-reduce of ``n`` bytes takes
        ``2 (p-1) alpha + 2 (p-1)/p * n / B``, an all-gather of ``n`` bytes per worker
        ``(p-1) alpha + (p-1) * n / B``.  The scaling projection
        (:mod:`~tf_blocksparse.planning.scaling`) prices the modes with it.

        Raises:
          ValueError: ``workers`` not an int >= 1, a negative ``alpha_s`` or a bandwidth
            <= 0, naming the argument.
        """
        p = count("workers", workers, 1)
        alpha = number("alpha_s", alpha_s)
        bandwidth = number("bandwidth_bytes_per_s", bandwidth_bytes_per_s, positive=True)
        return cls(2 * (p - 1) * alpha, 2 * (p - 1) / p / bandwidth,
                   (p - 1) * alpha, (p - 1) / bandwidth)

    def sum_seconds(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` (0 for an empty buffer: no collective runs)."""
        return self.sum_latency_s + self.sum_s_per_byte * nbytes if nbytes > 0 else 0.0

    def gather_seconds(self, nbytes: float) -> float:
        """One all-gather of ``nbytes`` per replica (0 for an empty buffer)."""
        return self.gather_latency_s + self.gather_s_per_byte * nbytes if nbytes > 0 else 0.0

    @property
    def sum_mbit_s(self) -> float:
        """Effective all-reduce rate in Mbit/s of reduced buffer (inf when free)."""
        return math.inf if self.sum_s_per_byte == 0 else 8e-6 / self.sum_s_per_byte


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line, both clamped to >= 0."""
    n = len(xs)
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    var = math.fsum((x - mx) ** 2 for x in xs)
    slope = max(0.0, math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
    return max(0.0, my - slope * mx), slope


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """One fusion group's sizes (bytes one replica hands over) and compression time.

    Attributes:
      dense_bytes: All its gradients, the dense all-reduce's buffer.
      whole_bytes: Its variables sent whole by the sparse modes (summed densely).
      id_bytes: Allgather's id buffer (4 per kept block, plus the 4-byte flag).
      value_bytes: The kept blocks' values.
      score_bytes: Shared mode's score buffer (4 per block).
      compress_s: Measured accumulate + score + select + residual time.
      recurrent_bytes: Of the delayed bytes (:attr:`delayed_bytes`), those of recurrent
        layers' variables (:data:`tf_blocksparse.blocks.RECURRENT_CLASSES`), whose delay
        costs more steps than others'.
    """

    dense_bytes: int
    whole_bytes: int = 0
    id_bytes: int = 0
    value_bytes: int = 0
    score_bytes: int = 0
    compress_s: float = 0.0
    recurrent_bytes: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            number(f.name, getattr(self, f.name))
        if self.recurrent_bytes > self.delayed_bytes:
            raise ValueError(f"`recurrent_bytes` ({self.recurrent_bytes}) must not exceed the "
                             f"delayed bytes ({self.delayed_bytes})")

    @property
    def delayed_bytes(self) -> int:
        """Bytes under error feedback when this group is sparse (all but the whole)."""
        return self.dense_bytes - self.whole_bytes


def mode_seconds(link: LinkCost, group: GroupCost, mode: str) -> float:
    """Predicted seconds per step of ``group``'s exchange in ``mode`` (module docstring)."""
    if mode == "dense":
        return link.sum_seconds(group.dense_bytes)
    sparse = group.value_bytes > 0
    base = group.compress_s + link.sum_seconds(group.whole_bytes)
    if mode == "allgather":
        return base + (link.gather_seconds(group.id_bytes)
                       + link.gather_seconds(group.value_bytes) if sparse else 0.0)
    if mode == "shared":
        return base + (link.sum_seconds(group.score_bytes)
                       + link.sum_seconds(group.value_bytes) if sparse else 0.0)
    raise ValueError(f"`mode` must be one of {EXCHANGES}, got {mode!r}")


def _join(a: GroupCost, b: GroupCost) -> GroupCost:
    """Two adjacent groups exchanged as one (one id buffer keeps one non-finite flag)."""
    flag = 4 if a.id_bytes and b.id_bytes else 0
    return GroupCost(a.dense_bytes + b.dense_bytes, a.whole_bytes + b.whole_bytes,
                     a.id_bytes + b.id_bytes - flag, a.value_bytes + b.value_bytes,
                     a.score_bytes + b.score_bytes, a.compress_s + b.compress_s,
                     a.recurrent_bytes + b.recurrent_bytes)


def merge_runs(items: Sequence[T], modes: Sequence[str], join: Callable[[T, T], T]
               ) -> tuple[list[T], list[str]]:
    """Joins adjacent items (fusion groups, in backward order) that use the same mode, so
    each run of a mode is exchanged once (one set of collectives).  The optimizer wrapper
    merges its groups' variables with it and :func:`exchange_seconds` their costs, so the
    model prices exactly what runs."""
    out: list[T] = []
    out_modes: list[str] = []
    for item, mode in zip(items, modes):
        if out_modes and out_modes[-1] == mode:
            out[-1] = join(out[-1], item)
        else:
            out.append(item)
            out_modes.append(mode)
    return out, out_modes


def exchange_seconds(link: LinkCost, groups: Sequence[GroupCost], modes: Sequence[str]
                     ) -> float:
    """Predicted seconds per step of all groups' exchanges with ``modes``; adjacent groups
    with the same mode are exchanged together (:func:`merge_runs`)."""
    runs, run_modes = merge_runs(groups, modes, _join)
    return math.fsum(mode_seconds(link, g, m) for g, m in zip(runs, run_modes))
