"""The bucketing baselines the balanced planner is compared with: TF, PyTorch DDP, Horovod.

Each reproduces how that framework groups gradients into fusion buffers, as a
:class:`~tf_blocksparse.fusion.plan.FusionPlan` over the same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan import FusionPlan, TensorSpec, plan_from_runs, resolve_order

__all__ = ["plan_ddp", "plan_horovod_greedy", "plan_tf_group_by_size"]


def plan_tf_group_by_size(tensors: Sequence[TensorSpec], bytes_per_pack: int,
                          order: Sequence[int] | None = None) -> FusionPlan:
    """TensorFlow's packing (``CollectiveAllReduce`` with ``bytes_per_pack``).

    TF reverses the gradient list (to follow backward order) and walks it, starting a new pack
    once the current pack holds more than ``bytes_per_pack``: packs are at least that large,
    so they may overshoot it.  ``bytes_per_pack == 0`` means one pack.  A dtype change also
    closes a pack here (TF concatenates a pack into one tensor).
    """
    order = resolve_order(tensors, order)
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
    return plan_from_runs("tf_group_by_size", bytes_per_pack, tensors, runs)


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
    for i in resolve_order(tensors, order):
        dt = tensors[i].dtype
        open_.setdefault(dt, []).append(i)
        size[dt] = size.get(dt, 0) + tensors[i].nbytes
        if size[dt] >= caps.setdefault(dt, first_bucket_bytes):
            runs.append(open_.pop(dt))
            size[dt], caps[dt] = 0, bucket_bytes
    runs.extend(open_.values())
    return plan_from_runs("ddp", bucket_bytes, tensors, runs)


def plan_horovod_greedy(tensors: Sequence[TensorSpec], fusion_bytes: int = 128 * 2**20,
                        order: Sequence[int] | None = None) -> FusionPlan:
    """Horovod-style greedy fusion with everything ready at once.

    Walks the ready order and adds each tensor to the current buffer while the sum stays
    within ``fusion_bytes`` (same dtype only); otherwise starts a new buffer.
    """
    order = resolve_order(tensors, order)
    runs: list[list[int]] = []
    acc = 0
    for i in order:
        t = tensors[i]
        if not runs or acc + t.nbytes > fusion_bytes or tensors[runs[-1][0]].dtype != t.dtype:
            runs.append([])
            acc = 0
        runs[-1].append(i)
        acc += t.nbytes
    return plan_from_runs("horovod_greedy", fusion_bytes, tensors, runs)
