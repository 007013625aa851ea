"""Balanced tensor fusion: which gradients share one all-reduce buffer.

The planner (TensorFlow-free; what this package imports and exports):

- :mod:`~tf_blocksparse.fusion.plan`: fusion plans (:class:`TensorSpec`,
  :class:`FusionGroup`, :class:`FusionPlan`) and the execution order of gradients.
- :mod:`~tf_blocksparse.fusion.balanced`: the balanced planner (offline half).
- :mod:`~tf_blocksparse.fusion.baselines`: TF's, PyTorch DDP's and Horovod's
  bucketing, for comparison; :mod:`~tf_blocksparse.fusion.compare` puts every method
  side by side.
- :mod:`~tf_blocksparse.fusion.schedule`: the online per-cycle scheduler (online half)
  and a cycle simulator.

Its runtime side, on TensorFlow (imported by its users, never here):
:mod:`~tf_blocksparse.fusion.forward_order` derives a model's gradient order from its forward
pass.  The buckets themselves run through the core's exchange hook
(:func:`tf_blocksparse.hooks.buckets_for`).
"""

from .balanced import MAX_LOWER_BOUNDS, min_imbalance, plan_backward, plan_balanced
from .baselines import plan_ddp, plan_horovod_greedy, plan_tf_group_by_size
from .compare import compare_plans, plan_summary
from .plan import FusionGroup, FusionPlan, TensorSpec, execution_order
from .schedule import FusionScheduler, simulate, simulate_greedy_cycles

__all__ = [
    "MAX_LOWER_BOUNDS", "FusionGroup", "FusionPlan", "FusionScheduler", "TensorSpec",
    "compare_plans", "execution_order", "min_imbalance", "plan_backward", "plan_balanced",
    "plan_ddp", "plan_horovod_greedy", "plan_summary", "plan_tf_group_by_size", "simulate",
    "simulate_greedy_cycles",
]
