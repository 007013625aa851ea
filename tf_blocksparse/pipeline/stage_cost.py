"""Pipeline stages and the cost model of one stage.

A stage holds layers ``i..j`` of a chain model and runs data parallel on its devices ``D_s =
(d_0, ..., d_{r-1})`` (ring order).  Its time per micro-batch is

``T_s = sum(compute_s[i..j]) / r + comm_in + sync`` where

* ``comm_in = activation_bytes[i-1] / bw[last device of D_{s-1}][d_0]`` for ``s > 0`` (else 0),
* ``sync = 2 (r-1)/r * sum(param_bytes[i..j]) / min_t bw[d_t][d_{(t+1) mod r}]`` for ``r > 1``
  (a ring all-reduce limited by its slowest edge; else 0).

Plans of stages (:class:`~tf_blocksparse.pipeline.plan.PipelinePlan`) and their bottleneck
``max_s T_s`` are in :mod:`~tf_blocksparse.pipeline.plan`.  Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .profile import ModelProfile
from .topology import Topology

__all__ = ["Stage", "StageSpan", "evaluate_stages", "stage_time"]

_RTOL = 1e-9


def close_enough(a: float, b: float, rtol: float = _RTOL) -> bool:
    """Whether two modelled times agree to the relative tolerance ``rtol``."""
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
        elif not close_enough(float(self.time_s), total):
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
