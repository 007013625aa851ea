"""Hybrid conv/FC training: memory-aware placement of the model on devices and expanded
memory, and the runtime that trains it.

The placement planner (standard library only; what this package imports and exports):

- :mod:`~tf_blocksparse.hybrid.memory`: what each layer holds
  (:class:`LayerMemory`), the budgets (:class:`MemoryBudget`) and the memory accounting.
- :mod:`~tf_blocksparse.hybrid.plan`: a placement (:class:`PlacementPlan`).
- :mod:`~tf_blocksparse.hybrid.planner`: the greedy planner
  (:func:`plan_placement`) and the step-time cost model (:func:`evaluate_placement`).

The runtime, on TensorFlow (imported by its users, never here):
:mod:`~tf_blocksparse.hybrid.split` finds a Keras model's conv/FC boundary, splits it there and
lists every layer's memory for the planner, :mod:`~tf_blocksparse.hybrid.sync` sums a group's
gradients (dense or block-sparse) and :mod:`~tf_blocksparse.hybrid.trainer` trains the two
groups (:class:`~tf_blocksparse.HybridTrainer`, over the shared :mod:`tf_blocksparse.runtime`).
"""

from .memory import DEVICE, EXPANDED, LayerMemory, MemoryBudget
from .plan import LayerPlacement, PlacementPlan
from .planner import evaluate_placement, plan_placement

__all__ = [
    "DEVICE", "EXPANDED", "LayerMemory", "LayerPlacement", "MemoryBudget", "PlacementPlan",
    "evaluate_placement", "plan_placement",
]
