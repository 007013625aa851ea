"""Pure-Python planners (no TensorFlow import): decide offline, before a strategy exists.

- :mod:`~tf_blocksparse.planning.fusion`: fusion plans (SPEC S1) and the TF / DDP / Horovod
  bucketing baselines; :mod:`~tf_blocksparse.planning.balanced`: the balanced planner;
  :mod:`~tf_blocksparse.planning.compare`: every method side by side.
- :mod:`~tf_blocksparse.planning.schedule`: the online per-cycle fusion scheduler and a cycle
  simulator.
- :mod:`~tf_blocksparse.planning.profile` (per-layer model profiles),
  :mod:`~tf_blocksparse.planning.topology` (devices and pairwise bandwidths),
  :mod:`~tf_blocksparse.planning.pipeline_cost` (pipeline plans and their cost model),
  :mod:`~tf_blocksparse.planning.pipeline` (the bandwidth-aware pipeline planner, SPEC S3, with
  exhaustive and brute-force checks), :mod:`~tf_blocksparse.planning.pipeline_baselines`
  (PipeDream and bandwidth-oblivious baselines) and
  :mod:`~tf_blocksparse.planning.pipeline_sim` (GPipe / 1F1B schedule simulator).
- :mod:`~tf_blocksparse.planning.placement`: memory-aware conv/FC placement (SPEC S4).
- :mod:`~tf_blocksparse.planning.scaling`: alpha-beta cost model of the exchanges.

Other planners live beside these as sibling modules.
"""

from .balanced import min_imbalance, plan_backward, plan_balanced
from .compare import compare_plans, plan_summary
from .fusion import (
    FusionGroup,
    FusionPlan,
    TensorSpec,
    execution_order,
    plan_ddp,
    plan_horovod_greedy,
    plan_tf_group_by_size,
)
from .pipeline import (
    PipelinePlan,
    Stage,
    evaluate_stages,
    make_plan,
    plan_bruteforce,
    plan_cost,
    plan_exhaustive,
    plan_pipeline,
    stage_time,
    validate_plan,
)
from .pipeline_baselines import (
    compare_pipeline_plans,
    pipedream_levels,
    plan_oblivious,
    plan_pipedream,
)
from .pipeline_sim import schedule_order, simulate_pipeline
from .placement import (
    LayerMemory,
    LayerPlacement,
    MemoryBudget,
    PlacementPlan,
    evaluate_placement,
    plan_placement,
)
from .profile import LayerProfile, ModelProfile, random_profile, synthetic_profile
from .scaling import (
    ExchangeCost,
    NetworkModel,
    allgather_mode_time,
    allgather_time,
    dense_mode_time,
    exchange_cost,
    ring_allreduce_time,
    scaling_efficiency,
    shared_mode_time,
)
from .schedule import FusionScheduler, simulate, simulate_greedy_cycles
from .topology import Topology, homogeneous, random_heterogeneous, two_level

__all__ = [
    "FusionGroup", "FusionPlan", "FusionScheduler", "TensorSpec", "compare_plans",
    "execution_order", "min_imbalance", "plan_backward", "plan_balanced", "plan_ddp",
    "plan_horovod_greedy", "plan_summary", "plan_tf_group_by_size", "simulate",
    "simulate_greedy_cycles",
    # pipeline planning (SPEC S3)
    "LayerProfile", "ModelProfile", "PipelinePlan", "Stage", "Topology",
    "compare_pipeline_plans", "evaluate_stages", "homogeneous", "make_plan", "plan_bruteforce",
    "pipedream_levels", "plan_cost", "plan_exhaustive", "plan_oblivious", "plan_pipedream",
    "plan_pipeline",
    "random_heterogeneous", "random_profile", "schedule_order", "simulate_pipeline",
    "stage_time", "synthetic_profile", "two_level", "validate_plan",
    # memory-aware hybrid placement (SPEC S4)
    "LayerMemory", "LayerPlacement", "MemoryBudget", "PlacementPlan", "evaluate_placement",
    "plan_placement",
    # alpha-beta scaling projection
    "ExchangeCost", "NetworkModel", "allgather_mode_time", "allgather_time", "dense_mode_time",
    "exchange_cost", "ring_allreduce_time", "scaling_efficiency", "shared_mode_time",
]
