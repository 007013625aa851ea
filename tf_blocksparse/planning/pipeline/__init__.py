"""Pipeline parallelism on a heterogeneous network: plans, planners and a schedule simulator.

- :mod:`~tf_blocksparse.planning.pipeline.plan`: pipeline plans (:class:`Stage`,
  :class:`PipelinePlan`) and their cost model.
- :mod:`~tf_blocksparse.planning.pipeline.partition`: the bandwidth-aware planner
  (:func:`plan_pipeline`) with exhaustive and brute-force checks.
- :mod:`~tf_blocksparse.planning.pipeline.pipedream` (PipeDream's hierarchical planner) and
  :mod:`~tf_blocksparse.planning.pipeline.baselines` (a bandwidth-oblivious split, every planner
  side by side): baselines evaluated with the same cost model.
- :mod:`~tf_blocksparse.planning.pipeline.simulator`: GPipe / 1F1B schedule simulator.

The plans' inputs are a :class:`~tf_blocksparse.planning.profile.ModelProfile` and a
:class:`~tf_blocksparse.planning.topology.Topology`.
"""

from .baselines import compare_pipeline_plans, plan_oblivious
from .partition import plan_bruteforce, plan_exhaustive, plan_pipeline
from .pipedream import pipedream_levels, plan_pipedream
from .plan import (
    PipelinePlan,
    Stage,
    evaluate_stages,
    make_plan,
    plan_cost,
    stage_time,
    validate_plan,
)
from .simulator import schedule_order, simulate_pipeline

__all__ = [
    "PipelinePlan", "Stage", "compare_pipeline_plans", "evaluate_stages", "make_plan",
    "pipedream_levels", "plan_bruteforce", "plan_cost", "plan_exhaustive", "plan_oblivious",
    "plan_pipedream", "plan_pipeline", "schedule_order", "simulate_pipeline", "stage_time",
    "validate_plan",
]
