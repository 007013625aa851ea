"""Balanced tensor fusion: which gradients share one all-reduce buffer.

- :mod:`~tf_blocksparse.planning.fusion.plan`: fusion plans (:class:`TensorSpec`,
  :class:`FusionGroup`, :class:`FusionPlan`) and the execution order of gradients.
- :mod:`~tf_blocksparse.planning.fusion.balanced`: the balanced planner (offline half).
- :mod:`~tf_blocksparse.planning.fusion.baselines`: TF's, PyTorch DDP's and Horovod's
  bucketing, for comparison; :mod:`~tf_blocksparse.planning.fusion.compare` puts every method
  side by side.
- :mod:`~tf_blocksparse.planning.fusion.schedule`: the online per-cycle scheduler (online half)
  and a cycle simulator.
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
