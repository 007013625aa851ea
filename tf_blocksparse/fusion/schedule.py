"""Online half of balanced tensor fusion: per-cycle group scheduling and a cycle simulator.

Each execution cycle reports the gradients that became ready (the *response list*).  The
scheduler merges them with the gradients still pending from earlier cycles, emits every plan
group that is now complete (to be fused and reduced as one buffer) and keeps the rest pending
for the next cycle.  Pure Python: no TensorFlow import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .plan import FusionGroup, FusionPlan, TensorSpec, execution_order

__all__ = ["FusionScheduler", "simulate", "simulate_greedy_cycles"]

_EPS = 1e-12


class FusionScheduler:
    """Splits each cycle's response list into complete groups to fuse and pending tensors.

    Args:
        plan: The offline group list (for example from :func:`plan_balanced`).
    """

    def __init__(self, plan: FusionPlan) -> None:
        self.plan = plan
        self._group_of = {i: g for g, grp in enumerate(plan.groups) for i in grp.members}
        self._position = {i: p for p, i in enumerate(plan.order)}
        self._missing = [len(g.members) for g in plan.groups]
        self._pending: set[int] = set()
        self._seen: set[int] = set()
        self._emitted = 0

    @property
    def pending(self) -> tuple[int, ...]:
        """Ready tensors not yet fused, in execution order."""
        return tuple(sorted(self._pending, key=self._position.__getitem__))

    @property
    def done(self) -> bool:
        """Whether every group of the plan has been emitted in this step."""
        return self._emitted == len(self.plan.groups)

    def step(self, response_list: Sequence[int]) -> tuple[list[FusionGroup], tuple[int, ...]]:
        """Handles one execution cycle.

        Args:
            response_list: Tensor indices whose gradients became ready in this cycle.

        Returns:
            ``(to_fuse, pending)``: the groups completed by this cycle, in plan order, and the
            ready tensors left pending (merged into the next cycle's response list).

        Raises:
            ValueError: ``response_list`` holds an unknown index, or one already reported
                in this training step (or twice).
        """
        ids = list(response_list)
        unknown = [i for i in ids if i not in self._group_of]
        if unknown:
            raise ValueError(f"response_list holds unknown tensor ids {unknown}")
        if len(set(ids)) != len(ids) or self._seen.intersection(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1 or i in self._seen})
            raise ValueError(f"response_list repeats tensor ids {dup} within this step")
        self._seen.update(ids)
        self._pending.update(ids)
        touched = set()
        for i in ids:
            g = self._group_of[i]
            self._missing[g] -= 1
            touched.add(g)
        to_fuse = [self.plan.groups[g] for g in sorted(touched) if self._missing[g] == 0]
        for grp in to_fuse:
            self._pending.difference_update(grp.members)
        self._emitted += len(to_fuse)
        return to_fuse, self.pending

    def reset(self) -> None:
        """Starts a new training step (forgets pending and reported tensors)."""
        self._missing = [len(g.members) for g in self.plan.groups]
        self._pending.clear()
        self._seen.clear()
        self._emitted = 0


def _cycles(ready_times_s: Sequence[float], cycle_s: float,
            rank: Sequence[int]) -> list[list[int]]:
    """Response lists: cycle k (at ``k * cycle_s``) gets the tensors ready since cycle k-1."""
    if cycle_s <= 0:
        raise ValueError("cycle_s must be > 0")
    if any(t < 0 for t in ready_times_s):
        raise ValueError("ready_times_s must be >= 0")
    index = [max(0, math.ceil((t - _EPS) / cycle_s)) for t in ready_times_s]
    cycles: list[list[int]] = [[] for _ in range(max(index, default=-1) + 1)]
    for i in sorted(range(len(index)), key=lambda i: (ready_times_s[i], rank[i])):
        cycles[index[i]].append(i)
    return cycles


def _summary(method: str, cycle_s: float, per_cycle: list[list[int]],
             groups: list[list[tuple[int, ...]]]) -> dict:
    buffers = [b for c in per_cycle for b in c]
    last = max((k for k, c in enumerate(per_cycle) if c), default=0)
    largest, smallest = max(buffers, default=0), min(buffers, default=0)
    return {
        "method": method, "cycle_s": cycle_s, "fused_bytes_per_cycle": per_cycle,
        "groups_per_cycle": groups, "buffers": buffers, "collectives": len(buffers),
        "last_start_s": last * cycle_s, "largest_bytes": largest, "smallest_bytes": smallest,
        "imbalance": (largest / smallest if smallest else float("inf")) if largest else 1.0,
    }


def simulate(plan: FusionPlan, ready_times_s: Sequence[float], cycle_s: float) -> dict:
    """Runs :class:`FusionScheduler` over one training step with cycles every ``cycle_s``.

    Cycle k happens at ``k * cycle_s`` (k = 0, 1, ...) and reports the tensors whose
    ``ready_times_s[i]`` falls in ``((k-1) * cycle_s, k * cycle_s]``.

    Args:
        plan: The group list.
        ready_times_s: Per tensor index, when its gradient is ready (seconds into backward).
        cycle_s: Cycle period in seconds.

    Returns:
        ``method``, ``cycle_s``, ``fused_bytes_per_cycle`` (per cycle, the bytes of each buffer
        it reduces), ``groups_per_cycle`` (their members), ``buffers`` (all buffer sizes),
        ``collectives`` (buffers per step), ``last_start_s`` (when the last collective can
        start), ``largest_bytes``, ``smallest_bytes`` and ``imbalance`` of the buffers.
    """
    if len(ready_times_s) != len(plan.tensors):
        raise ValueError("ready_times_s needs one time per tensor")
    rank = [0] * len(plan.order)
    for p, i in enumerate(plan.order):
        rank[i] = p
    sched = FusionScheduler(plan)
    per_cycle, groups = [], []
    for response in _cycles(ready_times_s, cycle_s, rank):
        to_fuse, _ = sched.step(response)
        per_cycle.append([g.nbytes for g in to_fuse])
        groups.append([g.members for g in to_fuse])
    return _summary(plan.method, cycle_s, per_cycle, groups)


def simulate_greedy_cycles(tensors: Sequence[TensorSpec], ready_times_s: Sequence[float],
                           cycle_s: float, fusion_bytes: int = 128 * 2**20) -> dict:
    """Horovod's online behaviour: each cycle fuses whatever is ready, up to the threshold.

    Within a cycle the ready tensors (by ready time, ties in backward order) fill buffers of
    one dtype while the sum stays within ``fusion_bytes``; every ready tensor is reduced in the
    cycle it is reported, so nothing waits for a group to complete.

    Args:
        tensors: Gradient specs.
        ready_times_s: Per tensor index, when its gradient is ready.
        cycle_s: Cycle period in seconds (Horovod's ``HOROVOD_CYCLE_TIME``).
        fusion_bytes: Fusion threshold (``HOROVOD_FUSION_THRESHOLD``).

    Returns:
        The same keys as :func:`simulate`, with ``method`` ``"horovod_cycles"``.
    """
    if len(ready_times_s) != len(tensors):
        raise ValueError("ready_times_s needs one time per tensor")
    rank = [0] * len(tensors)
    for p, i in enumerate(execution_order(len(tensors))):
        rank[i] = p
    per_cycle, groups = [], []
    for response in _cycles(ready_times_s, cycle_s, rank):
        bufs: list[list[int]] = []
        open_: dict[str, int] = {}  # dtype -> index into bufs of its open buffer
        sizes: list[int] = []
        for i in response:
            t = tensors[i]
            b = open_.get(t.dtype)
            if b is None or sizes[b] + t.nbytes > fusion_bytes:
                open_[t.dtype] = b = len(bufs)
                bufs.append([])
                sizes.append(0)
            bufs[b].append(i)
            sizes[b] += t.nbytes
        per_cycle.append(sizes)
        groups.append([tuple(b) for b in bufs])
    return _summary("horovod_cycles", cycle_s, per_cycle, groups)
