"""Pipeline plans and their cost model.

A plan splits the layers ``0..L-1`` of a chain model into consecutive stages; stage ``s`` holds
layers ``i..j`` and runs data parallel on its devices ``D_s = (d_0, ..., d_{r-1})`` (ring
order).  Its time per micro-batch is

``T_s = sum(compute_s[i..j]) / r + comm_in + sync`` where

* ``comm_in = activation_bytes[i-1] / bw[last device of D_{s-1}][d_0]`` for ``s > 0`` (else 0),
* ``sync = 2 (r-1)/r * sum(param_bytes[i..j]) / min_t bw[d_t][d_{(t+1) mod r}]`` for ``r > 1``
  (a ring all-reduce limited by its slowest edge; else 0),

and the plan's *bottleneck* is ``max_s T_s``.  Each device serves at most one stage; not every
device must be used.  The planners live in :mod:`~tf_blocksparse.pipeline.partition`
(the bandwidth-aware dynamic program, exhaustive and brute-force searches),
:mod:`~tf_blocksparse.pipeline.pipedream` and
:mod:`~tf_blocksparse.pipeline.baselines`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .profile import ModelProfile
from .topology import Topology

__all__ = [
    "PipelinePlan", "Stage", "evaluate_stages", "make_plan", "plan_cost", "stage_time",
    "validate_plan",
]

_RTOL = 1e-9


def _close(a: float, b: float, rtol: float = _RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-300)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        first_layer: Its first layer (inclusive).
        last_layer: Its last layer (inclusive).
        devices: Its device ids in ring order (data-parallel replicas); non-empty, distinct.
        compute_s: ``sum(compute_s[first..last]) / len(devices)``.
        comm_in_s: Time to receive its input activation from the previous stage (0 for the
            first stage).
        sync_s: Its ring all-reduce of parameters (0 for one device).
        time_s: ``compute_s + comm_in_s + sync_s`` (computed when not given).
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]
    compute_s: float = 0.0
    comm_in_s: float = 0.0
    sync_s: float = 0.0
    time_s: float | None = None

    def __post_init__(self) -> None:
        for arg in ("first_layer", "last_layer"):
            v = getattr(self, arg)
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ValueError(f"Stage: {arg} must be an int >= 0, got {v!r}")
            object.__setattr__(self, arg, int(v))
        if self.last_layer < self.first_layer:
            raise ValueError(f"Stage: last_layer {self.last_layer} < first_layer "
                             f"{self.first_layer}")
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("Stage: devices must not be empty")
        if any(isinstance(d, bool) or int(d) != d or d < 0 for d in devices):
            raise ValueError(f"Stage: devices must be ints >= 0, got {devices}")
        devices = tuple(int(d) for d in devices)
        if len(set(devices)) != len(devices):
            raise ValueError(f"Stage: devices repeat a device: {devices}")
        object.__setattr__(self, "devices", devices)
        for arg in ("compute_s", "comm_in_s", "sync_s"):
            v = float(getattr(self, arg))
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"Stage: {arg} must be finite and >= 0, got {v}")
            object.__setattr__(self, arg, v)
        total = self.compute_s + self.comm_in_s + self.sync_s
        if self.time_s is None:
            object.__setattr__(self, "time_s", total)
        elif not _close(float(self.time_s), total):
            raise ValueError(f"Stage: time_s {self.time_s} != compute + comm_in + sync {total}")
        else:
            object.__setattr__(self, "time_s", float(self.time_s))

    @property
    def num_layers(self) -> int:
        """Number of layers it holds."""
        return self.last_layer - self.first_layer + 1

    @property
    def replicas(self) -> int:
        """Number of devices (data-parallel replicas)."""
        return len(self.devices)

    def to_dict(self) -> dict[str, Any]:
        """The stage as a JSON-ready dict."""
        return {"first_layer": self.first_layer, "last_layer": self.last_layer,
                "devices": list(self.devices), "compute_s": self.compute_s,
                "comm_in_s": self.comm_in_s, "sync_s": self.sync_s, "time_s": self.time_s}


StageSpan = Stage | tuple[int, int, Sequence[int]]


def _check_structure(stages: Sequence[Stage], num_layers: int | None,
                     num_devices: int | None) -> None:
    """Contiguous from layer 0, in order, devices never reused (and in range / covering)."""
    if not stages:
        raise ValueError("stages must not be empty")
    expect = 0
    seen: set[int] = set()
    for k, st in enumerate(stages):
        if st.first_layer != expect:
            raise ValueError(f"stages: stage {k} starts at layer {st.first_layer}, expected "
                             f"{expect} (stages must be contiguous and in order from layer 0)")
        expect = st.last_layer + 1
        reused = seen.intersection(st.devices)
        if reused:
            raise ValueError(f"stages: stage {k} reuses devices {sorted(reused)}")
        seen.update(st.devices)
        if num_devices is not None and max(st.devices) >= num_devices:
            raise ValueError(f"stages: stage {k} uses device {max(st.devices)} of a "
                             f"{num_devices}-device topology")
    if num_layers is not None and expect != num_layers:
        raise ValueError(f"stages cover layers 0..{expect - 1}, the profile has {num_layers}")


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline partition and placement with its modelled stage times.

    Attributes:
        stages: The stages, covering layers ``0..L-1`` in order.
        bottleneck_s: ``max(stage.time_s)`` (computed when not given).
        method: Which planner made it.
        device_order: The device ordering the planner searched over (bandwidth order for
            :func:`plan_pipeline`, ids for the baselines); informational.
    """

    stages: tuple[Stage, ...]
    bottleneck_s: float | None = None
    method: str = "custom"
    device_order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        if not all(isinstance(s, Stage) for s in stages):
            raise ValueError("PipelinePlan: stages must all be Stage")
        _check_structure(stages, None, None)
        object.__setattr__(self, "stages", stages)
        worst = max(s.time_s for s in stages)
        if self.bottleneck_s is None:
            object.__setattr__(self, "bottleneck_s", worst)
        elif not _close(float(self.bottleneck_s), worst):
            raise ValueError(f"PipelinePlan: bottleneck_s {self.bottleneck_s} != max stage "
                             f"time {worst}")
        else:
            object.__setattr__(self, "bottleneck_s", float(self.bottleneck_s))
        object.__setattr__(self, "device_order", tuple(int(d) for d in self.device_order))

    @property
    def num_layers(self) -> int:
        """Layers covered (``last_layer + 1`` of the last stage)."""
        return self.stages[-1].last_layer + 1

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def devices_used(self) -> tuple[int, ...]:
        """All devices of the plan, stage by stage."""
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def throughput(self) -> float:
        """``1 / bottleneck_s``: micro-batches per second in steady state (inf if 0)."""
        return 1.0 / self.bottleneck_s if self.bottleneck_s > 0 else math.inf

    def validate(self, profile: ModelProfile, topology: Topology | None = None,
                 rtol: float = 1e-7) -> None:
        """See :func:`validate_plan`."""
        validate_plan(self, profile, topology, rtol)

    def to_json(self) -> str:
        """Serialises the plan; ``PipelinePlan.from_json(p.to_json()) == p``."""
        return json.dumps({"method": self.method, "bottleneck_s": self.bottleneck_s,
                           "device_order": list(self.device_order),
                           "stages": [s.to_dict() for s in self.stages]})

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        return cls(stages=tuple(Stage(**s) for s in d["stages"]),
                   bottleneck_s=d["bottleneck_s"], method=d["method"],
                   device_order=tuple(d.get("device_order", ())))


def _check_span(profile: ModelProfile, topology: Topology, first_layer: int, last_layer: int,
                devices: Sequence[int]) -> tuple[int, ...]:
    if not 0 <= first_layer <= last_layer < profile.num_layers:
        raise ValueError(f"first_layer/last_layer must satisfy 0 <= {first_layer} <= "
                         f"{last_layer} < {profile.num_layers}")
    devices = tuple(devices)
    if not devices or len(set(devices)) != len(devices):
        raise ValueError(f"devices must be non-empty and distinct, got {devices}")
    if any(not 0 <= d < topology.num_devices for d in devices):
        raise ValueError(f"devices {devices} out of range for {topology.num_devices} devices")
    return devices


def stage_time(profile: ModelProfile, topology: Topology, first_layer: int, last_layer: int,
               devices: Sequence[int],
               prev_devices: Sequence[int] | None = None) -> tuple[float, float, float]:
    """The cost model of one stage (see the module docstring).

    Args:
        profile: The model profile.
        topology: The cluster.
        first_layer: The stage's first layer (inclusive).
        last_layer: Its last layer (inclusive).
        devices: Its devices in ring order.
        prev_devices: The previous stage's devices (required when ``first_layer > 0``: its
            last device sends the input activation to ``devices[0]``).

    Returns:
        ``(compute, comm_in, sync)`` in seconds; the stage time is their sum.
    """
    devices = _check_span(profile, topology, first_layer, last_layer, devices)
    r = len(devices)
    compute = sum(profile.compute[first_layer:last_layer + 1]) / r
    comm_in = 0.0
    if first_layer > 0:
        if not prev_devices:
            raise ValueError("prev_devices is required for a stage with first_layer > 0")
        src = tuple(prev_devices)[-1]
        if src in devices:
            raise ValueError(f"prev_devices' last device {src} is also in devices")
        comm_in = profile.activation_bytes[first_layer - 1] / topology.bandwidth[src][devices[0]]
    sync = 0.0
    if r > 1:
        params = sum(profile.param_bytes[first_layer:last_layer + 1])
        sync = 2 * (r - 1) / r * params / topology.ring_bandwidth(devices)
    return float(compute), float(comm_in), float(sync)


def _span(st: StageSpan) -> tuple[int, int, tuple[int, ...]]:
    if isinstance(st, Stage):
        return st.first_layer, st.last_layer, st.devices
    first, last, devices = st
    return int(first), int(last), tuple(devices)


def evaluate_stages(profile: ModelProfile, topology: Topology,
                    spans: Iterable[StageSpan]) -> tuple[Stage, ...]:
    """Stages with their modelled times.

    Args:
        profile: The model profile.
        topology: The cluster.
        spans: Per stage, a :class:`Stage` (its times are ignored) or ``(first_layer,
            last_layer, devices)``.

    Returns:
        The stages with ``compute_s``, ``comm_in_s``, ``sync_s`` and ``time_s`` from
        :func:`stage_time`.
    """
    out: list[Stage] = []
    prev: tuple[int, ...] | None = None
    for span in spans:
        first, last, devices = _span(span)
        c, m, s = stage_time(profile, topology, first, last, devices, prev)
        out.append(Stage(first, last, devices, c, m, s))
        prev = devices
    return tuple(out)


def make_plan(profile: ModelProfile, topology: Topology, spans: Iterable[StageSpan],
              method: str = "custom", device_order: Sequence[int] = ()) -> PipelinePlan:
    """A validated :class:`PipelinePlan` of ``spans`` evaluated with the cost model."""
    plan = PipelinePlan(evaluate_stages(profile, topology, spans), None, method,
                        tuple(device_order))
    _check_structure(plan.stages, profile.num_layers, topology.num_devices)
    return plan


def plan_cost(profile: ModelProfile, topology: Topology, stages: Iterable[StageSpan]) -> float:
    """The bottleneck ``max_s T_s`` of ``stages`` (Stage objects or spans) under the model."""
    evaluated = evaluate_stages(profile, topology, stages)
    _check_structure(evaluated, profile.num_layers, topology.num_devices)
    return max(s.time_s for s in evaluated)


def validate_plan(plan: PipelinePlan, profile: ModelProfile, topology: Topology | None = None,
                  rtol: float = 1e-7) -> None:
    """Checks a plan against a profile (and topology), raising ``ValueError``.

    Stages are contiguous and in order, cover layers ``0..L-1`` exactly, have non-empty device
    tuples and never reuse a device; with ``topology`` the devices exist and every stage's
    times and the bottleneck equal the cost model's (relative tolerance ``rtol``).
    """
    _check_structure(plan.stages, profile.num_layers,
                     None if topology is None else topology.num_devices)
    if topology is None:
        return
    for k, (got, want) in enumerate(zip(plan.stages, evaluate_stages(profile, topology,
                                                                     plan.stages))):
        for arg in ("compute_s", "comm_in_s", "sync_s", "time_s"):
            if not _close(getattr(got, arg), getattr(want, arg), rtol):
                raise ValueError(f"plan: stage {k} {arg} = {getattr(got, arg)}, the cost model "
                                 f"gives {getattr(want, arg)}")
    worst = max(s.time_s for s in plan.stages)
    if not _close(plan.bottleneck_s, worst, rtol):
        raise ValueError(f"plan: bottleneck_s {plan.bottleneck_s} != max stage time {worst}")
