"""Every fusion method on the same gradients, summarised side by side.

Pure Python, no TensorFlow: the balanced planner of
:mod:`~tf_blocksparse.fusion.balanced` against TF's ``group_by_size``, PyTorch DDP's
buckets and Horovod's greedy fusion (:mod:`~tf_blocksparse.fusion.baselines`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .balanced import plan_balanced
from .baselines import plan_ddp, plan_horovod_greedy, plan_tf_group_by_size
from .plan import FusionPlan, TensorSpec

__all__ = ["compare_plans", "plan_summary"]


def plan_summary(plan: FusionPlan) -> dict:
    """``method``, ``buffer_bytes``, group count, largest / smallest bytes and the ratios."""
    return {"method": plan.method, "buffer_bytes": plan.buffer_bytes,
            "groups": len(plan.groups), "largest_bytes": plan.largest,
            "smallest_bytes": plan.smallest, "imbalance": plan.imbalance,
            "imbalance_excluding_oversized": plan.imbalance_excluding_oversized,
            "imbalance_excluding_single_oversized": plan.imbalance_excluding_single_oversized}


def compare_plans(tensors: Sequence[TensorSpec], buffer_bytes: int,
                  order: Sequence[int] | None = None, defaults: bool = False) -> list[dict]:
    """Plans ``tensors`` with every method at one buffer size and summarises each.

    DDP gets ``buffer_bytes`` as its bucket cap (first bucket ``min(1 MiB, buffer_bytes)``).
    With ``defaults`` two more rows give the baselines at their *own* defaults, whatever
    ``buffer_bytes`` is: ``ddp_default`` (25 MiB buckets, 1 MiB first bucket) and
    ``horovod_greedy_128mib``.

    Args:
        tensors: Gradient specs, indexed as in the variable list.
        buffer_bytes: The buffer size every method gets.
        order: Execution order (default: reverse of the list).
        defaults: Whether to add the two rows at the baselines' defaults.

    Returns:
        One dict per method: ``method``, ``buffer_bytes``, ``groups``, ``largest_bytes``,
        ``smallest_bytes``, ``imbalance``, ``imbalance_excluding_oversized`` and
        ``imbalance_excluding_single_oversized`` (see :class:`FusionPlan`).
    """
    plans = [
        plan_balanced(tensors, buffer_bytes, order),
        plan_tf_group_by_size(tensors, buffer_bytes, order),
        plan_ddp(tensors, buffer_bytes, min(2**20, buffer_bytes), order),
        plan_horovod_greedy(tensors, buffer_bytes, order),
    ]
    rows = [plan_summary(p) for p in plans]
    if defaults:
        rows.append({**plan_summary(plan_ddp(tensors, order=order)), "method": "ddp_default"})
        rows.append({**plan_summary(plan_horovod_greedy(tensors, order=order)),
                     "method": "horovod_greedy_128mib"})
    return rows
