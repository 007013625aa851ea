"""Memory-aware placement of a hybrid conv/FC model on devices and expanded memory.

- :mod:`~tf_blocksparse.planning.placement.memory`: what each layer holds
  (:class:`LayerMemory`), the budgets (:class:`MemoryBudget`) and the memory accounting.
- :mod:`~tf_blocksparse.planning.placement.plan`: a placement (:class:`PlacementPlan`).
- :mod:`~tf_blocksparse.planning.placement.planner`: the greedy planner
  (:func:`plan_placement`) and the step-time cost model (:func:`evaluate_placement`).

Pure Python (standard library only).
"""

from .memory import DEVICE, EXPANDED, LayerMemory, MemoryBudget
from .plan import LayerPlacement, PlacementPlan
from .planner import evaluate_placement, plan_placement

__all__ = [
    "DEVICE", "EXPANDED", "LayerMemory", "LayerPlacement", "MemoryBudget", "PlacementPlan",
    "evaluate_placement", "plan_placement",
]
