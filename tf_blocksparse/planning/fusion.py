"""Fusion plans (SPEC S1) and the bucketing baselines the balanced planner is compared with.

Pure Python over frozen dataclasses: no TensorFlow import, so plans can be built, checked and
stored (JSON) before a strategy exists.  Tensors are referred to by their index in ``tensors``.

A plan lists fusion groups, each a contiguous run of the *execution order* (the order in which
gradients become ready, i.e. backward order).  A buffer never mixes dtypes; a tensor larger than
the buffer is reduced in its own group; one that fills the buffer (*oversized*) may, in the
balanced planner
(:mod:`~tf_blocksparse.planning.balanced`), carry up to one buffer of the tensors ready just
before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FusionGroup", "FusionPlan", "TensorSpec", "execution_order", "plan_ddp",
    "plan_horovod_greedy", "plan_tf_group_by_size",
]


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
    :func:`tf_blocksparse.keras.forward_order.forward_use_order` derives it from a trace of the
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


def _resolve_order(tensors: Sequence[TensorSpec], order: Sequence[int] | None) -> tuple[int, ...]:
    if order is None:
        return execution_order(len(tensors))
    order = tuple(order)
    if sorted(order) != list(range(len(tensors))):
        raise ValueError(f"order must be a permutation of range({len(tensors)})")
    return order


def _make_plan(method: str, buffer_bytes: int, tensors: Sequence[TensorSpec],
               runs: Sequence[Sequence[int]]) -> FusionPlan:
    tensors = tuple(tensors)
    groups = tuple(FusionGroup(tuple(r), sum(tensors[i].nbytes for i in r)) for r in runs if r)
    order = tuple(i for g in groups for i in g.members)
    return FusionPlan(method, int(buffer_bytes), order, groups, tensors)


def plan_tf_group_by_size(tensors: Sequence[TensorSpec], bytes_per_pack: int,
                          order: Sequence[int] | None = None) -> FusionPlan:
    """TensorFlow's packing (``CollectiveAllReduce`` with ``bytes_per_pack``).

    TF reverses the gradient list (to follow backward order) and walks it, starting a new pack
    once the current pack holds more than ``bytes_per_pack``: packs are at least that large,
    so they may overshoot it.  ``bytes_per_pack == 0`` means one pack.  A dtype change also
    closes a pack here (TF concatenates a pack into one tensor).
    """
    order = _resolve_order(tensors, order)
    runs: list[list[int]] = []
    acc = 0
    for i in order:
        t = tensors[i]
        if not runs or (bytes_per_pack > 0 and acc > bytes_per_pack) or \
                tensors[runs[-1][0]].dtype != t.dtype:
            runs.append([])
            acc = 0
        runs[-1].append(i)
        acc += t.nbytes
    return _make_plan("tf_group_by_size", bytes_per_pack, tensors, runs)


def plan_ddp(tensors: Sequence[TensorSpec], bucket_bytes: int = 25 * 2**20,
             first_bucket_bytes: int = 2**20, order: Sequence[int] | None = None
             ) -> FusionPlan:
    """PyTorch DDP's buckets (after its first-iteration rebuild).

    Parameters in ready ``order`` (default: reverse of the list); one open bucket per dtype;
    a tensor is added and the bucket is closed once it reaches its cap (``first_bucket_bytes``
    for a dtype's first bucket, then ``bucket_bytes``), so a bucket may overshoot its cap by
    its last tensor.  Buckets are listed in the order they close, open leftovers last; the
    plan's ``order`` is their concatenation.
    """
    open_: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    caps: dict[str, int] = {}
    runs: list[list[int]] = []
    for i in _resolve_order(tensors, order):
        dt = tensors[i].dtype
        open_.setdefault(dt, []).append(i)
        size[dt] = size.get(dt, 0) + tensors[i].nbytes
        if size[dt] >= caps.setdefault(dt, first_bucket_bytes):
            runs.append(open_.pop(dt))
            size[dt], caps[dt] = 0, bucket_bytes
    runs.extend(open_.values())
    return _make_plan("ddp", bucket_bytes, tensors, runs)


def plan_horovod_greedy(tensors: Sequence[TensorSpec], fusion_bytes: int = 128 * 2**20,
                        order: Sequence[int] | None = None) -> FusionPlan:
    """Horovod-style greedy fusion with everything ready at once.

    Walks the ready order and adds each tensor to the current buffer while the sum stays
    within ``fusion_bytes`` (same dtype only); otherwise starts a new buffer.
    """
    order = _resolve_order(tensors, order)
    runs: list[list[int]] = []
    acc = 0
    for i in order:
        t = tensors[i]
        if not runs or acc + t.nbytes > fusion_bytes or tensors[runs[-1][0]].dtype != t.dtype:
            runs.append([])
            acc = 0
        runs[-1].append(i)
        acc += t.nbytes
    return _make_plan("horovod_greedy", fusion_bytes, tensors, runs)
