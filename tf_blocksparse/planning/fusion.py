"""Offline balanced tensor fusion (SPEC S1) and the bucketing baselines it is compared with.

Pure Python over frozen dataclasses: no TensorFlow import, so plans can be built, checked and
stored (JSON) before a strategy exists.  Tensors are referred to by their index in ``tensors``.

A plan lists fusion groups, each a contiguous run of the *execution order* (the order in which
gradients become ready, i.e. backward order).  A buffer never mixes dtypes; a tensor larger than
the buffer is reduced alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FusionGroup", "FusionPlan", "TensorSpec", "compare_plans", "execution_order",
    "plan_backward", "plan_balanced", "plan_ddp", "plan_horovod_greedy", "plan_tf_group_by_size",
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

    def validate(self, check_size_bound: bool = True) -> None:
        """Checks the plan's invariants, raising ``ValueError`` on the first one broken.

        Every tensor appears exactly once in ``order`` and in the groups; the groups are
        contiguous runs of ``order`` in order; each group's ``nbytes`` is its members' sum and
        its members share one dtype; with ``check_size_bound`` each group is at most
        ``buffer_bytes`` unless it is a single tensor larger than the buffer.  (TF's and DDP's
        packs may overshoot their size by design: check them with ``check_size_bound=False``.)

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
                raise ValueError(f"{self.method}: group {g.members} ({g.nbytes} B) exceeds the "
                                 f"{self.buffer_bytes} B buffer")

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


def execution_order(num_tensors: int,
                    forward_use_order: Sequence[int] | None = None) -> tuple[int, ...]:
    """Order in which gradients become ready: the reverse of the forward use order.

    Backpropagation visits the variables in the reverse of the order the forward pass used
    them.  For a Keras Sequential or functional *chain*, ``model.trainable_variables`` is
    already in forward creation/use order, so the default (``range(num_tensors)``) applies to
    gradients listed like it; pass ``forward_use_order`` (variable indices in the order the
    forward pass first uses them) when it differs (shared layers, branches, subclassed models
    that create variables out of call order).

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


def _segments(sizes: list[int], dtypes: list[str], bound: int) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs of one dtype with no tensor above ``bound``."""
    segs, start = [], 0
    for k in range(len(sizes) + 1):
        end = k == len(sizes) or sizes[k] > bound or (k > start and dtypes[k] != dtypes[start])
        if end:
            if k > start:
                segs.append((start, k))
            start = k + 1 if k < len(sizes) and sizes[k] > bound else k
    return segs


def _greedy_count(sizes: list[int], lo: int, hi: int, cap: int) -> int:
    """Fewest groups of ``sizes[lo:hi]`` with sums <= cap (greedy fill is optimal)."""
    count, acc = 0, None
    for s in sizes[lo:hi]:
        if acc is None or acc + s > cap:
            count, acc = count + 1, s
        else:
            acc += s
    return count


def _min_groups_cuts(sizes: list[int], lo: int, hi: int, low: int, cap: int) -> list[int] | None:
    """Fewest groups of ``sizes[lo:hi]`` with sums in [low, cap]; returns the cut points.

    ``best[i]`` = fewest groups for the first i tensors; predecessors j of i are those with
    prefix sum in [P_i - cap, P_i - low], a window moving right, so a monotone deque keeps the
    minimum: O(n).
    """
    n = hi - lo
    pre = [0] * (n + 1)
    for k in range(n):
        pre[k + 1] = pre[k] + sizes[lo + k]
    inf = n + 1
    best, parent = [inf] * (n + 1), [-1] * (n + 1)
    best[0] = 0
    dq: list[int] = []
    head = a = b = 0  # dq[head:] holds candidates; [a, b) are the j added so far
    for i in range(1, n + 1):
        while b < i and pre[i] - pre[b] >= low:  # j = b becomes admissible (sum >= low)
            while len(dq) > head and best[dq[-1]] >= best[b]:
                dq.pop()
            dq.append(b)
            b += 1
        while pre[i] - pre[a] > cap:  # j = a too far back (sum > cap)
            a += 1
        while len(dq) > head and dq[head] < a:
            head += 1
        if len(dq) > head and best[dq[head]] < inf:
            best[i], parent[i] = best[dq[head]] + 1, dq[head]
    if best[n] >= inf:
        return None
    cuts, i = [], n
    while i > 0:
        cuts.append(lo + i)
        i = parent[i]
    return cuts[::-1]


def plan_balanced(tensors: Sequence[TensorSpec], buffer_bytes: int,
                  order: Sequence[int] | None = None) -> FusionPlan:
    """Balanced groups (SPEC S1): fewest buffers, then the smallest possible largest buffer.

    The execution-ordered tensors are split into contiguous single-dtype groups of at most
    ``buffer_bytes`` (an oversized tensor alone).  Exact lexicographic optimum of: (1) fewest
    groups; (2) smallest largest group; (3) largest smallest group.  (2) binary-searches a cap
    with a greedy count check; (3) binary-searches a lower bound with an O(n) window DP.

    Args:
        tensors: Gradient specs, indexed as in the model's variable list.
        buffer_bytes: Fusion buffer size in bytes (> 0).
        order: Execution order; default :func:`execution_order` (reverse of the list).

    Returns:
        The ``"balanced"`` plan.
    """
    if buffer_bytes <= 0:
        raise ValueError("buffer_bytes must be > 0")
    order = _resolve_order(tensors, order)
    sizes = [tensors[i].nbytes for i in order]
    dtypes = [tensors[i].dtype for i in order]
    segs = _segments(sizes, dtypes, buffer_bytes)
    targets = [_greedy_count(sizes, a, b, buffer_bytes) for a, b in segs]

    def count_ok(cap: int) -> bool:
        return all(_greedy_count(sizes, a, b, cap) == t for (a, b), t in zip(segs, targets))

    lo_cap = max((sizes[k] for a, b in segs for k in range(a, b)), default=0)
    hi_cap = buffer_bytes
    while lo_cap < hi_cap:  # smallest cap keeping the fewest groups
        mid = (lo_cap + hi_cap) // 2
        lo_cap, hi_cap = (lo_cap, mid) if count_ok(mid) else (mid + 1, hi_cap)
    # With an oversized tensor the largest group is that tensor whatever the cap: then only
    # the buffer bounds the other groups while the smallest group is maximised.
    cap = buffer_bytes if any(s > buffer_bytes for s in sizes) else lo_cap

    def cuts_for(low: int) -> list[list[int]] | None:
        out = []
        for (a, b), t in zip(segs, targets):
            cuts = _min_groups_cuts(sizes, a, b, low, cap)
            if cuts is None or len(cuts) != t:
                return None
            out.append(cuts)
        return out

    lo_low, hi_low = 0, cap
    while lo_low < hi_low:  # largest lower bound still feasible with the fewest groups
        mid = (lo_low + hi_low + 1) // 2
        lo_low, hi_low = (mid, hi_low) if cuts_for(mid) is not None else (lo_low, mid - 1)
    edges = {0, len(sizes)}
    for (a, _), cuts in zip(segs, cuts_for(lo_low) or []):
        edges.update([a, *cuts])
    edges.update(k + d for k, s in enumerate(sizes) if s > buffer_bytes for d in (0, 1))
    edges = sorted(edges)
    runs = [list(order[a:b]) for a, b in zip(edges, edges[1:])]
    return _make_plan("balanced", buffer_bytes, tensors, runs)


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
             first_bucket_bytes: int = 2**20) -> FusionPlan:
    """PyTorch DDP's buckets (after its first-iteration rebuild).

    Parameters in reverse order; one open bucket per dtype; a tensor is added and the bucket
    is closed once it reaches its cap (``first_bucket_bytes`` for a dtype's first bucket, then
    ``bucket_bytes``), so a bucket may overshoot its cap by its last tensor.  Buckets are listed
    in the order they close, open leftovers last; ``order`` is their concatenation.
    """
    open_: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    caps: dict[str, int] = {}
    runs: list[list[int]] = []
    for i in execution_order(len(tensors)):
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


def plan_backward(nbytes: Sequence[int], dtypes: Sequence[str], buffer_bytes: int,
                  names: Sequence[str] | None = None) -> FusionPlan:
    """The balanced plan of gradients listed in forward (variable) order.

    Args:
      nbytes: Bytes of each gradient, in the order of the model's variables.
      dtypes: Their dtype names.
      buffer_bytes: The fusion buffer size.
      names: Optional names (default ``gradient_<i>``).

    Returns:
      :func:`plan_balanced` over the backward order (the reverse of the variable order).
    """
    names = names or [f"gradient_{i}" for i in range(len(nbytes))]
    specs = [TensorSpec(n, int(b), d) for n, b, d in zip(names, nbytes, dtypes)]
    return plan_balanced(specs, buffer_bytes, execution_order(len(specs)))


def compare_plans(tensors: Sequence[TensorSpec], buffer_bytes: int) -> list[dict]:
    """Plans ``tensors`` with every method at one buffer size and summarises each.

    DDP gets ``buffer_bytes`` as its bucket cap (first bucket ``min(1 MiB, buffer_bytes)``).

    Returns:
        One dict per method: ``method``, ``groups``, ``largest_bytes``, ``smallest_bytes``,
        ``imbalance``.
    """
    plans = [
        plan_balanced(tensors, buffer_bytes),
        plan_tf_group_by_size(tensors, buffer_bytes),
        plan_ddp(tensors, buffer_bytes, min(2**20, buffer_bytes)),
        plan_horovod_greedy(tensors, buffer_bytes),
    ]
    return [{"method": p.method, "groups": len(p.groups), "largest_bytes": p.largest,
             "smallest_bytes": p.smallest, "imbalance": p.imbalance} for p in plans]
