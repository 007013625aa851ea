"""Memory-aware placement of a hybrid conv/FC model on devices and expanded memory (SPEC S4).

Pure Python (standard library only).  The model is split at the conv/FC boundary: the *conv
group* (group A, the layers before the boundary) trains data-parallel on ``conv_replicas``
devices, the *FC group* (group B, the layers after it, ``LayerMemory.is_fc``) on
``fc_replicas`` devices whose nodes have *expanded memory* (CXL memory, emulated by host
memory).  Every layer is placed either on the ``"device"`` of its group's replicas or in
``"expanded"`` memory.

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

Placement rule of :func:`plan_placement` (greedy, deterministic):

1. Start with every layer on the device (with ``offload_fc_group=True``: every FC-group layer
   with parameters in expanded memory -- the product default of SPEC S4).
2. While the FC group is over the device budget, move its layers with parameters to expanded
   memory, largest resident bytes first (ties: the later layer first).  A layer whose move
   would overflow the expanded budget is skipped.
3. Then, while the conv group is over the device budget (and ``allow_conv_offload``), do the
   same with the conv group's layers (the "largest remaining" layers; on a conv node the
   expanded memory is its host memory, with the same per-node budget).
4. If a group is still over the device budget, raise ``ValueError`` naming
   ``device_budget_bytes`` (and ``expanded_budget_bytes`` when a layer did not fit there).

Cost model (:func:`evaluate_placement`), seconds per training step, ``I = conv_replicas``,
``J = fc_replicas``, ``f = forward_fraction``, ``ring(b, k) = 2 (k - 1) / k * b / link``:

* ``conv_forward = f * sum(conv compute_s) / I``; ``conv_backward = (1 - f) * ... / I``
  (``compute_s`` is forward + backward of the global mini-batch on one device);
* ``activations_to_fc = boundary_bytes / J / link`` (a B replica receives the rows of its A
  replicas) and ``gradients_to_conv`` the same (activation gradients have the same size);
* ``fc_compute = sum(fc compute_s) / J``;
* ``*_host_stream = sum over expanded layers of 2 * param_bytes / host_bandwidth`` (weights in,
  gradient out) and ``*_host_update = sum of (3 * param_bytes + 2 * optimizer_state_bytes) /
  host_bandwidth`` (the optimizer step in expanded memory reads weights, gradient and slots
  and writes weights and slots; updates on the device are taken as free);
* ``fc_allreduce = ring(sum fc param_bytes, J)`` (after the FC backward, not overlapped);
* ``conv_allreduce_exposed = ring(first conv layer's param_bytes, I) + max(0, ring(other conv
  param_bytes, I) - conv_backward)``: every conv layer's gradient is all-reduced as soon as it
  is ready, overlapping the rest of the backward pass; only the first layer's (the last ready)
  is fully exposed.

``step_time_s`` is the sum of these terms (the A and B phases run one after the other).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEVICE", "EXPANDED", "LayerMemory", "LayerPlacement", "MemoryBudget", "PlacementPlan",
    "evaluate_placement", "plan_placement",
]

DEVICE = "device"
EXPANDED = "expanded"
_GROUPS = ("conv", "fc")


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


def _check_layers(layers: Iterable[LayerMemory]) -> tuple[LayerMemory, ...]:
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


def _check_replicas(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
    return value


def _ring(nbytes: float, k: int, link: float) -> float:
    return 2.0 * (k - 1) / k * nbytes / link if k > 1 else 0.0


def _group_bytes(layers: Sequence[LayerMemory], where: Mapping[str, str], group: str,
                 replicas: int, received: int) -> dict[str, int]:
    members = [x for x in layers if x.group == group]
    resident = sum(x.resident_bytes for x in members if where[x.name] == DEVICE)
    expanded = sum(x.resident_bytes for x in members if where[x.name] == EXPANDED)
    staging = 2 * max((x.param_bytes for x in members if where[x.name] == EXPANDED), default=0)
    acts = math.ceil((sum(x.activation_bytes for x in members) + received) / replicas)
    return {"device": resident + acts + staging, "expanded": expanded, "activations": acts,
            "staging": staging}


def evaluate_placement(layers: Sequence[LayerMemory], expanded: Iterable[str],
                       budget: MemoryBudget, conv_replicas: int = 1, fc_replicas: int = 1,
                       forward_fraction: float = 1.0 / 3.0) -> PlacementPlan:
    """Memory and predicted step time of a given placement (no budget check).

    Args:
        layers: The layers in forward order; the FC group (``is_fc``) is a suffix.
        expanded: Names of the layers in expanded memory (the rest are on the device).
        budget: Budgets and bandwidths.
        conv_replicas: ``I``, replicas of the conv group.
        fc_replicas: ``J``, replicas of the FC group.
        forward_fraction: Forward share of a layer's ``compute_s``.

    Returns:
        The :class:`PlacementPlan` (``fits`` says whether it is within the budgets).

    Raises:
        ValueError: Bad ``layers``, an unknown name in ``expanded``, bad replica counts or
            ``forward_fraction``.
    """
    layers = _check_layers(layers)
    if not isinstance(budget, MemoryBudget):
        raise ValueError(f"budget must be a MemoryBudget, got {budget!r}")
    i_rep = _check_replicas("conv_replicas", conv_replicas)
    j_rep = _check_replicas("fc_replicas", fc_replicas)
    if isinstance(forward_fraction, bool) or not isinstance(forward_fraction, (int, float)) \
            or not 0.0 <= forward_fraction <= 1.0:
        raise ValueError(f"forward_fraction must be in [0, 1], got {forward_fraction!r}")
    expanded = set(expanded)
    unknown = expanded - {x.name for x in layers}
    if unknown:
        raise ValueError(f"expanded: unknown layers {sorted(unknown)}")
    where = {x.name: EXPANDED if x.name in expanded else DEVICE for x in layers}
    conv = [x for x in layers if not x.is_fc]
    fc = [x for x in layers if x.is_fc]
    boundary = conv[-1].activation_bytes if conv and fc else 0
    group_bytes = {"conv": _group_bytes(layers, where, "conv", i_rep, 0),
                   "fc": _group_bytes(layers, where, "fc", j_rep, boundary)}
    link, host = budget.link_bandwidth, budget.host_bandwidth

    def stream(group: list[LayerMemory]) -> float:
        return sum(2 * x.param_bytes for x in group if where[x.name] == EXPANDED) / host

    def update(group: list[LayerMemory]) -> float:
        return sum(3 * x.param_bytes + 2 * x.optimizer_state_bytes
                   for x in group if where[x.name] == EXPANDED) / host

    conv_compute = sum(x.compute_s for x in conv) / i_rep
    conv_backward = (1.0 - forward_fraction) * conv_compute
    with_params = [x for x in conv if x.param_bytes]
    first = with_params[0].param_bytes if with_params else 0
    rest = sum(x.param_bytes for x in with_params[1:])
    breakdown = {
        "conv_forward": forward_fraction * conv_compute,
        "activations_to_fc": boundary / j_rep / link,
        "fc_compute": sum(x.compute_s for x in fc) / j_rep,
        "fc_host_stream": stream(fc),
        "fc_allreduce": _ring(sum(x.param_bytes for x in fc), j_rep, link),
        "fc_host_update": update(fc),
        "gradients_to_conv": boundary / j_rep / link,
        "conv_backward": conv_backward,
        "conv_host_stream": stream(conv),
        "conv_allreduce_exposed": _ring(first, i_rep, link)
        + max(0.0, _ring(rest, i_rep, link) - conv_backward),
        "conv_host_update": update(conv),
    }
    placements = tuple(LayerPlacement(x.name, x.group, where[x.name], x.resident_bytes)
                       for x in layers)
    return PlacementPlan(placements, budget, i_rep, j_rep, group_bytes, breakdown,
                         sum(breakdown.values()))


def plan_placement(layers: Sequence[LayerMemory], device_budget_bytes: float,
                   expanded_budget_bytes: float, host_bandwidth: float, link_bandwidth: float,
                   conv_replicas: int = 1, fc_replicas: int = 1, *,
                   offload_fc_group: bool = False, allow_conv_offload: bool = True,
                   forward_fraction: float = 1.0 / 3.0) -> PlacementPlan:
    """Decides which layers go to expanded memory (rule and cost model: module docstring).

    Args:
        layers: The layers in forward order; the FC group (``is_fc``) is a suffix.
        device_budget_bytes: Memory of one device (``math.inf``: no limit).
        expanded_budget_bytes: Expanded memory of one node (``math.inf``: no limit).
        host_bandwidth: Bytes/s between a device and expanded memory.
        link_bandwidth: Bytes/s of a node-to-node link.
        conv_replicas: ``I``, replicas of the conv group.
        fc_replicas: ``J``, replicas of the FC group.
        offload_fc_group: Put every FC-group layer with parameters in expanded memory even
            when the device could hold it (SPEC S4's product default).
        allow_conv_offload: Allow conv-group layers in expanded memory (step 3 of the rule).
        forward_fraction: Forward share of a layer's ``compute_s``.

    Returns:
        The chosen :class:`PlacementPlan`; ``plan.fits`` is true.

    Raises:
        ValueError: Bad arguments, or no placement fits: the message names
            ``device_budget_bytes`` (and ``expanded_budget_bytes`` where a layer that would have
            helped did not fit in expanded memory).
    """
    budget = MemoryBudget(device_budget_bytes, expanded_budget_bytes, host_bandwidth,
                          link_bandwidth)
    layers = _check_layers(layers)
    kwargs = {"conv_replicas": conv_replicas, "fc_replicas": fc_replicas,
              "forward_fraction": forward_fraction}
    expanded: list[str] = []
    if offload_fc_group:
        expanded = [x.name for x in layers if x.is_fc and x.param_bytes]
    plan = evaluate_placement(layers, expanded, budget, **kwargs)
    if plan.group_bytes["fc"]["expanded"] > budget.expanded_bytes:
        raise ValueError(f"expanded_budget_bytes={expanded_budget_bytes} cannot hold the FC "
                         f"group ({plan.group_bytes['fc']['expanded']} bytes per node) with "
                         "offload_fc_group=True")
    skipped: list[str] = []
    for group in _GROUPS[::-1]:  # the FC group first
        if group == "conv" and not allow_conv_offload:
            continue
        order = sorted((x for x in reversed(layers)
                        if x.group == group and x.param_bytes and x.name not in expanded),
                       key=lambda x: -x.resident_bytes)  # stable: later layer first on ties
        for layer in order:
            if plan.group_bytes[group]["device"] <= budget.device_bytes:
                break
            trial = evaluate_placement(layers, [*expanded, layer.name], budget, **kwargs)
            if trial.group_bytes[group]["expanded"] > budget.expanded_bytes:
                skipped.append(layer.name)
                continue
            expanded.append(layer.name)
            plan = trial
    over = [g for g in _GROUPS if plan.group_bytes[g]["device"] > budget.device_bytes]
    if over:
        parts = []
        for g in over:
            gb = plan.group_bytes[g]
            parts.append(f"the {g} group needs {gb['device']} bytes per device (activations "
                         f"{gb['activations']}, staging {gb['staging']}) with "
                         f"{[n for n in expanded if n in _names(layers, g)]} in expanded memory")
        msg = (f"no placement fits device_budget_bytes={device_budget_bytes}: "
               + "; ".join(parts))
        if skipped:
            msg += (f"; expanded_budget_bytes={expanded_budget_bytes} could not take "
                    f"{skipped}")
        if "conv" in over and not allow_conv_offload:
            msg += "; conv-group offload is disabled (allow_conv_offload=False)"
        raise ValueError(msg)
    return plan


def _names(layers: Sequence[LayerMemory], group: str) -> set[str]:
    return {x.name for x in layers if x.group == group}
