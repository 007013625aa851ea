"""Pure-Python planners (no TensorFlow import): decide offline, before a strategy exists.

Every planner's public name is importable from ``tf_blocksparse.planning``, wherever the
planner lives.  The planners of the products live with their runtime:

- :mod:`tf_blocksparse.fusion`: balanced tensor fusion -- fusion plans, the balanced
  planner, the TF / DDP / Horovod bucketing baselines, every method side by side, and the online
  per-cycle scheduler with its cycle simulator.
- :mod:`tf_blocksparse.pipeline`: pipeline plans and their cost model, the
  bandwidth-aware pipeline planner (with exhaustive and brute-force checks), the PipeDream and
  bandwidth-oblivious baselines, and the GPipe / 1F1B schedule simulator; their inputs, the
  per-layer model profiles (:mod:`~tf_blocksparse.pipeline.profile`) and the devices and
  pairwise bandwidths (:mod:`~tf_blocksparse.pipeline.topology`).
- :mod:`tf_blocksparse.hybrid`: memory-aware conv/FC placement on devices and
  expanded memory.

The cost models of the exchange itself, which the core and the automatic exchange use, live
here:

- :mod:`~tf_blocksparse.planning.link_cost`: the one cost model of the exchange modes
  (collectives as ``latency + bytes * seconds_per_byte``, each mode's collectives per step)
  and the mode names.
- :mod:`~tf_blocksparse.planning.exchange_cost`: the automatic exchange's policy over
  measured collective and compression times; :mod:`~tf_blocksparse.planning.exchange_decision`:
  what it decided.
- :mod:`~tf_blocksparse.planning.scaling`: the cost model's links derived from Hockney's
  alpha-beta ring model, and each mode's exchange time on them.
- :mod:`~tf_blocksparse.planning.projection`: the projected scaling efficiency of a mode
  on such a network.

Importing a product package (``tf_blocksparse.fusion``, ``.pipeline``, ``.hybrid``) loads its
planner only; ``tests/test_architecture.py`` checks that every planner stays TensorFlow-free.
"""

from tf_blocksparse.fusion import (
    FusionGroup,
    FusionPlan,
    FusionScheduler,
    TensorSpec,
    compare_plans,
    execution_order,
    min_imbalance,
    plan_backward,
    plan_balanced,
    plan_ddp,
    plan_horovod_greedy,
    plan_summary,
    plan_tf_group_by_size,
    simulate,
    simulate_greedy_cycles,
)
from tf_blocksparse.hybrid import (
    LayerMemory,
    LayerPlacement,
    MemoryBudget,
    PlacementPlan,
    evaluate_placement,
    plan_placement,
)
from tf_blocksparse.pipeline import (
    LayerProfile,
    ModelProfile,
    PipelinePlan,
    Stage,
    Topology,
    compare_pipeline_plans,
    evaluate_stages,
    homogeneous,
    make_plan,
    pipedream_levels,
    plan_bruteforce,
    plan_cost,
    plan_exhaustive,
    plan_oblivious,
    plan_pipedream,
    plan_pipeline,
    random_heterogeneous,
    random_profile,
    schedule_order,
    simulate_pipeline,
    stage_time,
    synthetic_profile,
    two_level,
    validate_plan,
)

from .exchange_cost import (
    AutoExchange,
    ExchangeDecision,
    GroupCost,
    LinkCost,
    exchange_seconds,
    mode_seconds,
)
from .projection import ExchangeCost, NetworkModel, exchange_cost, scaling_efficiency
from .scaling import (
    allgather_mode_time,
    allgather_time,
    dense_mode_time,
    ring_allreduce_time,
    shared_mode_time,
)

__all__ = [
    # automatic exchange
    "AutoExchange", "ExchangeDecision", "GroupCost", "LinkCost", "exchange_seconds",
    "mode_seconds",
    "FusionGroup", "FusionPlan", "FusionScheduler", "TensorSpec", "compare_plans",
    "execution_order", "min_imbalance", "plan_backward", "plan_balanced", "plan_ddp",
    "plan_horovod_greedy", "plan_summary", "plan_tf_group_by_size", "simulate",
    "simulate_greedy_cycles",
    # pipeline planning
    "LayerProfile", "ModelProfile", "PipelinePlan", "Stage", "Topology",
    "compare_pipeline_plans", "evaluate_stages", "homogeneous", "make_plan", "plan_bruteforce",
    "pipedream_levels", "plan_cost", "plan_exhaustive", "plan_oblivious", "plan_pipedream",
    "plan_pipeline",
    "random_heterogeneous", "random_profile", "schedule_order", "simulate_pipeline",
    "stage_time", "synthetic_profile", "two_level", "validate_plan",
    # memory-aware hybrid placement
    "LayerMemory", "LayerPlacement", "MemoryBudget", "PlacementPlan", "evaluate_placement",
    "plan_placement",
    # alpha-beta scaling projection
    "ExchangeCost", "NetworkModel", "allgather_mode_time", "allgather_time", "dense_mode_time",
    "exchange_cost", "ring_allreduce_time", "scaling_efficiency", "shared_mode_time",
]
