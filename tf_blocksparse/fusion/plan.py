"""Fusion plans: the tensors, their groups in execution order, and the plan's invariants.

Pure Python over frozen dataclasses: no TensorFlow import, so plans can be built, checked and
stored (JSON) before a strategy exists.  Tensors are referred to by their index in ``tensors``.

A plan lists fusion groups, each a contiguous run of the *execution order* (the order in which
gradients become ready, i.e. backward order).  A buffer never mixes dtypes; a tensor larger than
the buffer is reduced in its own group; one that fills the buffer (*oversized*) may, in the
balanced planner (:mod:`~tf_blocksparse.fusion.balanced`), carry up to one buffer of
the tensors ready just before it.  The bucketing baselines the balanced planner is compared
with live in :mod:`~tf_blocksparse.fusion.baselines`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FusionGroup", "FusionPlan", "TensorSpec", "execution_order", "plan_from_runs",
           "resolve_order"]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter gradient: a name, its size in bytes and its dtype name."""

    name: str
    nbytes: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if int(self.nbytes) != self.nbytes or self.nbytes < 0:
            raise ValueError(f"TensorSpec {self.name!r}: nbytes must be an int >= 0")


@dataclass(frozen=True)
class FusionGroup:
    """Tensor indices fused into one buffer (in execution order) and the buffer's bytes."""

    members: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FusionPlan:
    """A parameter-gradient group list.

    Attributes:
        method: Which planner made it (``"balanced"``, ``"tf_group_by_size"``, ...).
        buffer_bytes: The fusion buffer size (pack / bucket / threshold) it was made for.
        order: Execution order: tensor indices in the order their gradients become ready.
        groups: The fusion groups, contiguous runs of ``order``, in that order.
        tensors: The tensors the indices refer to.
    """

    method: str
    buffer_bytes: int
    order: tuple[int, ...]
    groups: tuple[FusionGroup, ...]
    tensors: tuple[TensorSpec, ...]

    @property
    def largest(self) -> int:
        """Bytes of the largest group (0 for an empty plan)."""
        return max((g.nbytes for g in self.groups), default=0)

    @property
    def smallest(self) -> int:
        """Bytes of the smallest group (0 for an empty plan)."""
        return min((g.nbytes for g in self.groups), default=0)

    @property
    def imbalance(self) -> float:
        """``largest / smallest``: 1.0 is perfectly even (inf if a group holds 0 bytes)."""
        if self.largest == 0:
            return 1.0
        return self.largest / self.smallest if self.smallest else float("inf")

    def is_oversized(self, group: FusionGroup) -> bool:
        """Whether ``group`` holds a tensor that fills the buffer alone (``>= buffer_bytes``)."""
        return any(self.tensors[i].nbytes >= self.buffer_bytes for i in group.members)

    @property
    def imbalance_excluding_oversized(self) -> float:
        """``largest / smallest`` over the groups holding no tensor that fills the buffer.

        1.0 when no such group is left (or all are empty); ``inf`` if one holds 0 bytes.
        """
        return _ratio([g.nbytes for g in self.groups if not self.is_oversized(g)])

    @property
    def imbalance_excluding_single_oversized(self) -> float:
        """The strict ``largest / smallest``: only groups that are one single tensor larger
        than the buffer (``> buffer_bytes``) are left out.

        Unlike :attr:`imbalance_excluding_oversized`, a group holding an oversized tensor *and*
        the small tensors riding along with it counts, as do tensors exactly the buffer's size.
        1.0 when no group is left; ``inf`` if one holds 0 bytes.
        """
        return _ratio([g.nbytes for g in self.groups
                       if not (len(g.members) == 1 and g.nbytes > self.buffer_bytes)])

    def validate(self, check_size_bound: bool = True) -> None:
        """Checks the plan's invariants, raising ``ValueError`` on the first one broken.

        Every tensor appears exactly once in ``order`` and in the groups; the groups are
        contiguous runs of ``order`` in order; each group's ``nbytes`` is its members' sum and
        its members share one dtype; with ``check_size_bound`` each group is at most
        ``buffer_bytes``, or holds exactly one tensor of at least the buffer's size and at most
        ``buffer_bytes`` of other tensors, all ready before it (it is the group's last member).
        (TF's and DDP's packs may overshoot their size by design: check them with
        ``check_size_bound=False``.)

        Args:
            check_size_bound: Whether to check the buffer-size bound.
        """
        n = len(self.tensors)
        if sorted(self.order) != list(range(n)):
            raise ValueError(f"{self.method}: order is not a permutation of range({n})")
        flat = [i for g in self.groups for i in g.members]
        if tuple(flat) != self.order:
            raise ValueError(f"{self.method}: groups are not contiguous runs of order")
        for g in self.groups:
            if not g.members:
                raise ValueError(f"{self.method}: empty group")
            if g.nbytes != sum(self.tensors[i].nbytes for i in g.members):
                raise ValueError(f"{self.method}: group {g.members} nbytes != sum of members")
            if len({self.tensors[i].dtype for i in g.members}) != 1:
                raise ValueError(f"{self.method}: group {g.members} mixes dtypes")
            if check_size_bound and g.nbytes > self.buffer_bytes and len(g.members) > 1:
                big = [i for i in g.members if self.tensors[i].nbytes >= self.buffer_bytes]
                extra = g.nbytes - sum(self.tensors[i].nbytes for i in big)
                if big != [g.members[-1]] or extra > self.buffer_bytes:
                    raise ValueError(f"{self.method}: group {g.members} ({g.nbytes} B) exceeds "
                                     f"the {self.buffer_bytes} B buffer")

    def to_json(self) -> str:
        """Serialises the plan; ``FusionPlan.from_json(p.to_json()) == p``."""
        return json.dumps({
            "method": self.method, "buffer_bytes": self.buffer_bytes, "order": list(self.order),
            "groups": [{"members": list(g.members), "nbytes": g.nbytes} for g in self.groups],
            "tensors": [{"name": t.name, "nbytes": t.nbytes, "dtype": t.dtype}
                        for t in self.tensors],
        })

    @classmethod
    def from_json(cls, text: str) -> FusionPlan:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        return cls(
            method=d["method"], buffer_bytes=int(d["buffer_bytes"]), order=tuple(d["order"]),
            groups=tuple(FusionGroup(tuple(g["members"]), int(g["nbytes"])) for g in d["groups"]),
            tensors=tuple(TensorSpec(t["name"], int(t["nbytes"]), t["dtype"])
                          for t in d["tensors"]),
        )


def _ratio(sizes: Sequence[int]) -> float:
    """``max / min`` of group sizes: 1.0 when empty or all 0, ``inf`` when one is 0."""
    if not sizes or max(sizes) == 0:
        return 1.0
    return max(sizes) / min(sizes) if min(sizes) else float("inf")


def execution_order(num_tensors: int,
                    forward_use_order: Sequence[int] | None = None) -> tuple[int, ...]:
    """Order in which gradients become ready: the reverse of the forward use order.

    Backpropagation visits the variables in the reverse of the order the forward pass first
    used them.  ``forward_use_order`` is that order as variable indices; the TF adapter
    :func:`tf_blocksparse.fusion.forward_order.forward_use_order` derives it from a trace of the
    model's forward pass (first read of each variable's handle).  Without it (``None``: no
    model known) this falls back to the reverse of the list order, which is right when the
    variables are listed in use order (Sequential models, functional chains) and only an
    approximation otherwise (subclassed models that create layers out of call order, shared
    layers, branches).

    Args:
        num_tensors: Number of gradients.
        forward_use_order: A permutation of ``range(num_tensors)``; ``None`` for the identity.

    Returns:
        Tensor indices in backward (ready) order.
    """
    fwd = tuple(range(num_tensors)) if forward_use_order is None else tuple(forward_use_order)
    if sorted(fwd) != list(range(num_tensors)):
        raise ValueError(f"forward_use_order must be a permutation of range({num_tensors})")
    return fwd[::-1]


def resolve_order(tensors: Sequence[TensorSpec], order: Sequence[int] | None) -> tuple[int, ...]:
    """``order`` checked as a permutation of the tensor indices; ``None``: the default
    execution order (:func:`execution_order`)."""
    if order is None:
        return execution_order(len(tensors))
    order = tuple(order)
    if sorted(order) != list(range(len(tensors))):
        raise ValueError(f"order must be a permutation of range({len(tensors)})")
    return order


def plan_from_runs(method: str, buffer_bytes: int, tensors: Sequence[TensorSpec],
                   runs: Sequence[Sequence[int]]) -> FusionPlan:
    """The plan whose groups are ``runs`` (empty runs dropped) and whose order is theirs."""
    tensors = tuple(tensors)
    groups = tuple(FusionGroup(tuple(r), sum(tensors[i].nbytes for i in r)) for r in runs if r)
    order = tuple(i for g in groups for i in g.members)
    return FusionPlan(method, int(buffer_bytes), order, groups, tensors)
