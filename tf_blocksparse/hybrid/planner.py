"""Memory-aware placement of a hybrid conv/FC model on devices and expanded memory.

Pure Python (standard library only).  The layers' memory, the budgets and the memory
accounting are described in :mod:`~tf_blocksparse.hybrid.memory`.

Placement rule of :func:`plan_placement` (greedy, deterministic):

1. Start with every layer on the device (with ``offload_fc_group=True``: every FC-group layer
   with parameters in expanded memory -- the product default).
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

from collections.abc import Iterable, Sequence
from typing import Any

from .memory import (
    DEVICE,
    EXPANDED,
    GROUPS,
    LayerMemory,
    MemoryBudget,
    bytes_per_replica,
    check_layers,
)
from .plan import LayerPlacement, PlacementPlan

__all__ = ["evaluate_placement", "plan_placement"]


def _check_replicas(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
    return value


def _ring(nbytes: float, k: int, link: float) -> float:
    return 2.0 * (k - 1) / k * nbytes / link if k > 1 else 0.0


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
    layers = check_layers(layers)
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
    group_bytes = {"conv": bytes_per_replica(layers, where, "conv", i_rep, 0),
                   "fc": bytes_per_replica(layers, where, "fc", j_rep, boundary)}
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
            when the device could hold it (the product default).
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
    layers = check_layers(layers)
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
    for group in GROUPS[::-1]:  # the FC group first
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
    over = [g for g in GROUPS if plan.group_bytes[g]["device"] > budget.device_bytes]
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
