"""A placement of a hybrid conv/FC model: where each layer lives, its memory and step time.

Made by :func:`~tf_blocksparse.hybrid.planner.plan_placement` or
:func:`~tf_blocksparse.hybrid.planner.evaluate_placement`; JSON round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .memory import EXPANDED, MemoryBudget

__all__ = ["LayerPlacement", "PlacementPlan"]


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer lives.

    Attributes:
        name: The layer's name.
        group: ``"conv"`` or ``"fc"``.
        placement: ``"device"`` or ``"expanded"``.
        resident_bytes: Its weights + gradient + optimizer-slot bytes (held where it is placed).
    """

    name: str
    group: str
    placement: str
    resident_bytes: int


@dataclass(frozen=True)
class PlacementPlan:
    """A placement, its per-replica memory and its predicted step time.

    Attributes:
        layers: One :class:`LayerPlacement` per layer, in forward order.
        budget: The budgets and bandwidths it was evaluated with.
        conv_replicas: Replicas ``I`` of the conv group.
        fc_replicas: Replicas ``J`` of the FC group.
        group_bytes: ``{"conv" | "fc": {"device": bytes, "expanded": bytes, "activations":
            bytes, "staging": bytes}}`` per replica.
        breakdown: The cost-model terms in seconds (see the module docstring).
        step_time_s: Their sum.
    """

    layers: tuple[LayerPlacement, ...]
    budget: MemoryBudget
    conv_replicas: int
    fc_replicas: int
    group_bytes: Mapping[str, Mapping[str, int]] = field(hash=False)
    breakdown: Mapping[str, float] = field(hash=False)
    step_time_s: float = 0.0

    def placement_of(self, name: str) -> str:
        """``"device"`` or ``"expanded"`` for layer ``name``."""
        for lp in self.layers:
            if lp.name == name:
                return lp.placement
        raise ValueError(f"name: no layer {name!r} in the plan")

    @property
    def expanded_layers(self) -> tuple[str, ...]:
        """Names of the layers in expanded memory, in forward order."""
        return tuple(lp.name for lp in self.layers if lp.placement == EXPANDED)

    @property
    def fits(self) -> bool:
        """Whether both groups are within the device and expanded budgets."""
        return all(g["device"] <= self.budget.device_bytes
                   and g["expanded"] <= self.budget.expanded_bytes
                   for g in self.group_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict."""
        return {
            "layers": [{"name": lp.name, "group": lp.group, "placement": lp.placement,
                        "resident_bytes": lp.resident_bytes} for lp in self.layers],
            "budget": self.budget.to_dict(), "conv_replicas": self.conv_replicas,
            "fc_replicas": self.fc_replicas,
            "group_bytes": {g: dict(v) for g, v in self.group_bytes.items()},
            "breakdown": dict(self.breakdown), "step_time_s": self.step_time_s,
            "expanded_layers": list(self.expanded_layers), "fits": self.fits,
        }

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.to_dict(), **kwargs)``."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlacementPlan:
        """Inverse of :meth:`to_dict` (derived keys are ignored)."""
        layers = tuple(LayerPlacement(x["name"], x["group"], x["placement"],
                                      int(x["resident_bytes"])) for x in d["layers"])
        return cls(layers, MemoryBudget.from_dict(d["budget"]), int(d["conv_replicas"]),
                   int(d["fc_replicas"]),
                   {g: {k: int(v) for k, v in vals.items()} for g, vals in
                    d["group_bytes"].items()},
                   {k: float(v) for k, v in d["breakdown"].items()}, float(d["step_time_s"]))

    @classmethod
    def from_json(cls, text: str) -> PlacementPlan:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))
