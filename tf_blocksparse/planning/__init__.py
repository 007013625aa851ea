"""Pure-Python planners (no TensorFlow import): decide offline, before a strategy exists.

- :mod:`~tf_blocksparse.planning.fusion`: balanced tensor fusion (SPEC S1) and the TF / DDP /
  Horovod bucketing baselines.
- :mod:`~tf_blocksparse.planning.schedule`: the online per-cycle fusion scheduler and a cycle
  simulator.

Other planners (e.g. pipeline partitioning) live beside these as sibling modules.
"""

from .fusion import (
    FusionGroup,
    FusionPlan,
    TensorSpec,
    compare_plans,
    execution_order,
    plan_backward,
    plan_balanced,
    plan_ddp,
    plan_horovod_greedy,
    plan_tf_group_by_size,
)
from .schedule import FusionScheduler, simulate, simulate_greedy_cycles

__all__ = [
    "FusionGroup", "FusionPlan", "FusionScheduler", "TensorSpec", "compare_plans",
    "execution_order", "plan_backward", "plan_balanced", "plan_ddp", "plan_horovod_greedy",
    "plan_tf_group_by_size", "simulate", "simulate_greedy_cycles",
]
