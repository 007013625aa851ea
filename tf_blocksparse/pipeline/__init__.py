"""Pipeline parallelism on a heterogeneous network: plans, planners, a schedule simulator and
the runtime that trains a plan.

The planner (TensorFlow-free; what this package imports and exports):

- :mod:`~tf_blocksparse.pipeline.stage_cost`: a stage (:class:`Stage`) and the cost model
  of one stage; :mod:`~tf_blocksparse.pipeline.plan`: pipeline plans
  (:class:`PipelinePlan`) and their bottleneck.
- :mod:`~tf_blocksparse.pipeline.partition`: the bandwidth-aware planner
  (:func:`plan_pipeline`) with exhaustive and brute-force checks.
- :mod:`~tf_blocksparse.pipeline.pipedream` (PipeDream's hierarchical planner) and
  :mod:`~tf_blocksparse.pipeline.baselines` (a bandwidth-oblivious split, every planner
  side by side): baselines evaluated with the same cost model.
- :mod:`~tf_blocksparse.pipeline.simulator`: GPipe / 1F1B schedule simulator.
- The plans' inputs: :mod:`~tf_blocksparse.pipeline.profile` (per-layer model profiles,
  :class:`ModelProfile`) and :mod:`~tf_blocksparse.pipeline.topology` (devices and pairwise
  bandwidths, :class:`Topology`).

The runtime, on TensorFlow (imported by its users, never here):
:mod:`~tf_blocksparse.pipeline.profiler` measures a Keras model's layers into a profile,
:mod:`~tf_blocksparse.pipeline.stages` checks a plan's stages against the model and
:mod:`~tf_blocksparse.pipeline.trainer` trains it (:class:`~tf_blocksparse.PipelineTrainer`,
over the shared :mod:`tf_blocksparse.runtime`).
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
from .profile import LayerProfile, ModelProfile, random_profile, synthetic_profile
from .simulator import schedule_order, simulate_pipeline
from .topology import Topology, homogeneous, random_heterogeneous, two_level

__all__ = [
    "LayerProfile", "ModelProfile", "PipelinePlan", "Stage", "Topology",
    "compare_pipeline_plans", "evaluate_stages", "homogeneous", "make_plan",
    "pipedream_levels", "plan_bruteforce", "plan_cost", "plan_exhaustive", "plan_oblivious",
    "plan_pipedream", "plan_pipeline", "random_heterogeneous", "random_profile",
    "schedule_order", "simulate_pipeline", "stage_time", "synthetic_profile", "two_level",
    "validate_plan",
]
