"""What a layer of a hybrid conv/FC model holds in memory, and the budgets it must fit.

Pure Python (standard library only), the inputs of the placement planner
(:mod:`~tf_blocksparse.hybrid.planner`).  The model is split at the conv/FC
boundary: the *conv group* (group A, the layers before the boundary) trains data-parallel on
``conv_replicas`` devices, the *FC group* (group B, the layers after it, ``LayerMemory.is_fc``)
on ``fc_replicas`` devices whose nodes have *expanded memory* (CXL memory, emulated by host
memory).  Every layer is placed either on the ``"device"`` of its group's replicas
(:data:`DEVICE`) or in ``"expanded"`` memory (:data:`EXPANDED`).

Memory accounting, per replica of a group (every replica of a group holds the same bytes):

* a layer on the device keeps its *resident bytes* there: ``2 * param_bytes +
  optimizer_state_bytes`` (the variables, their gradient buffer and the optimizer slots);
* a layer in expanded memory keeps its resident bytes in expanded memory instead, and its
  weights are streamed to the device for compute: the device holds a *staging* buffer of
  ``2 * max(param_bytes)`` over the group's expanded layers (one layer's weights and its
  gradient in flight at a time, layer-by-layer streaming);
* activations: every layer of the group keeps its output for the backward pass,
  ``activation_bytes / replicas`` per replica (``activation_bytes`` is for the whole global
  mini-batch); the FC group also holds its received input, the last conv-group layer's
  activation ``/ fc_replicas``.

``device bytes = resident (device layers) + activations + staging``;
``expanded bytes = resident (expanded layers)``.  A plan fits when both are within their
budgets for both groups (``device_budget_bytes`` per device, ``expanded_budget_bytes`` per
node).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DEVICE", "EXPANDED", "GROUPS", "LayerMemory", "MemoryBudget", "bytes_per_replica",
           "check_layers"]

#: A layer placed on its group's devices.
DEVICE = "device"
#: A layer placed in expanded memory.
EXPANDED = "expanded"
#: The two groups, in forward order.
GROUPS = ("conv", "fc")


def _check_number(owner: str, arg: str, value: Any, *, positive: bool = False,
                  integer: bool = False) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {arg} must be a number, got {value!r}")
    if integer and int(value) != value:
        raise ValueError(f"{owner}: {arg} must be an integer, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{owner}: {arg} must be finite and {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return int(value) if integer else float(value)


def _check_budget(arg: str, value: Any) -> float:
    """A budget in bytes: a number >= 0, or ``math.inf`` for no limit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value < 0:
        raise ValueError(f"{arg} must be a number of bytes >= 0 (math.inf for no limit), "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LayerMemory:
    """Memory and compute facts of one layer.

    Attributes:
        name: The layer's name (unique in the model).
        param_bytes: Bytes of its trainable variables.
        optimizer_state_bytes: Bytes of its optimizer slots (e.g. ``param_bytes`` for SGD with
            momentum, ``2 * param_bytes`` for Adam).
        activation_bytes: Bytes of its output for the whole global mini-batch.
        compute_s: Forward + backward seconds of the global mini-batch on one device.
        is_fc: Whether the layer belongs to the FC group (after the conv/FC boundary).
    """

    name: str
    param_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    compute_s: float = 0.0
    is_fc: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerMemory: name must be a non-empty str, got {self.name!r}")
        owner = f"LayerMemory {self.name!r}"
        for arg in ("param_bytes", "optimizer_state_bytes", "activation_bytes"):
            object.__setattr__(self, arg, _check_number(owner, arg, getattr(self, arg),
                                                        integer=True))
        object.__setattr__(self, "compute_s", _check_number(owner, "compute_s", self.compute_s))
        if not isinstance(self.is_fc, bool):
            raise ValueError(f"{owner}: is_fc must be a bool, got {self.is_fc!r}")

    @property
    def resident_bytes(self) -> int:
        """Bytes the layer keeps where it is placed: weights, gradient, optimizer slots."""
        return 2 * self.param_bytes + self.optimizer_state_bytes

    @property
    def group(self) -> str:
        """``"fc"`` or ``"conv"``."""
        return "fc" if self.is_fc else "conv"

    def to_dict(self) -> dict[str, Any]:
        """The layer as a JSON-ready dict."""
        return {"name": self.name, "param_bytes": self.param_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "activation_bytes": self.activation_bytes, "compute_s": self.compute_s,
                "is_fc": self.is_fc}


@dataclass(frozen=True)
class MemoryBudget:
    """Budgets and bandwidths of the cluster.

    Attributes:
        device_bytes: Memory of one device (every replica of both groups); ``math.inf`` for
            no limit.
        expanded_bytes: Expanded (host / CXL) memory of one node; ``math.inf`` for no limit.
        host_bandwidth: Bytes/s between a device and its node's expanded memory.
        link_bandwidth: Bytes/s of a node-to-node link (activations, all-reduce).
    """

    device_bytes: float
    expanded_bytes: float
    host_bandwidth: float
    link_bandwidth: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_bytes",
                           _check_budget("device_budget_bytes", self.device_bytes))
        object.__setattr__(self, "expanded_bytes",
                           _check_budget("expanded_budget_bytes", self.expanded_bytes))
        for arg in ("host_bandwidth", "link_bandwidth"):
            object.__setattr__(self, arg, _check_number("MemoryBudget", arg, getattr(self, arg),
                                                        positive=True))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (an unlimited budget is written as ``null``)."""
        def b(v: float) -> float | None:
            return None if math.isinf(v) else v
        return {"device_bytes": b(self.device_bytes), "expanded_bytes": b(self.expanded_bytes),
                "host_bandwidth": self.host_bandwidth, "link_bandwidth": self.link_bandwidth}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryBudget:
        """Inverse of :meth:`to_dict`."""
        def b(v: Any) -> float:
            return math.inf if v is None else v
        return cls(b(d["device_bytes"]), b(d["expanded_bytes"]), d["host_bandwidth"],
                   d["link_bandwidth"])


def check_layers(layers: Iterable[LayerMemory]) -> tuple[LayerMemory, ...]:
    """``layers`` as a tuple, checked: non-empty :class:`LayerMemory`\\ s with unique names whose
    FC group is a suffix.

    Raises:
        ValueError: Any of these does not hold.
    """
    layers = tuple(layers)
    if not layers:
        raise ValueError("layers must not be empty")
    if not all(isinstance(x, LayerMemory) for x in layers):
        raise ValueError("layers must all be LayerMemory")
    names = [x.name for x in layers]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"layers: names repeat: {repeated}")
    flags = [x.is_fc for x in layers]
    if any(a and not b for a, b in zip(flags, flags[1:])):
        raise ValueError("layers: the FC group (is_fc=True) must be a suffix of the forward "
                         "order (the layers after the conv/FC boundary)")
    return layers


def bytes_per_replica(layers: Sequence[LayerMemory], where: Mapping[str, str], group: str,
                      replicas: int, received: int) -> dict[str, int]:
    """One replica's bytes of ``group`` under the placement ``where`` (module docstring).

    Args:
        layers: The checked layers, in forward order.
        where: Layer name -> :data:`DEVICE` or :data:`EXPANDED`.
        group: ``"conv"`` or ``"fc"``.
        replicas: Replicas of the group (activations are split over them).
        received: Bytes of the group's received input for the whole mini-batch (the last
            conv layer's activation for the FC group, else 0).

    Returns:
        ``{"device", "expanded", "activations", "staging"}`` bytes per replica.
    """
    members = [x for x in layers if x.group == group]
    resident = sum(x.resident_bytes for x in members if where[x.name] == DEVICE)
    expanded = sum(x.resident_bytes for x in members if where[x.name] == EXPANDED)
    staging = 2 * max((x.param_bytes for x in members if where[x.name] == EXPANDED), default=0)
    acts = math.ceil((sum(x.activation_bytes for x in members) + received) / replicas)
    return {"device": resident + acts + staging, "expanded": expanded, "activations": acts,
            "staging": staging}
