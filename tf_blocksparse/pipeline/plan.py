"""Pipeline plans: stages over the whole model and their bottleneck.

A plan splits the layers ``0..L-1`` of a chain model into consecutive stages; stage ``s`` holds
layers ``i..j`` and runs data parallel on its devices.  Its time per micro-batch ``T_s`` is the
cost model of :mod:`~tf_blocksparse.pipeline.stage_cost`, and the plan's *bottleneck* is
``max_s T_s``.  Each device serves at most one stage; not every
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

from .profile import ModelProfile
from .stage_cost import Stage, StageSpan, close_enough, evaluate_stages, stage_time
from .topology import Topology

__all__ = [
    "PipelinePlan", "Stage", "evaluate_stages", "make_plan", "plan_cost", "stage_time",
    "validate_plan",
]


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
        elif not close_enough(float(self.bottleneck_s), worst):
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
            if not close_enough(getattr(got, arg), getattr(want, arg), rtol):
                raise ValueError(f"plan: stage {k} {arg} = {getattr(got, arg)}, the cost model "
                                 f"gives {getattr(want, arg)}")
    worst = max(s.time_s for s in plan.stages)
    if not close_enough(plan.bottleneck_s, worst, rtol):
        raise ValueError(f"plan: bottleneck_s {plan.bottleneck_s} != max stage time {worst}")
